"""Counter-based seeds: every (rank, step, tensor) draws from its own random stream.

A stream is a pure function of its coordinates, so a run can be replayed (tests feed the same
draws to the numpy reference), resumed from a checkpoint that stores only the step, and ranks
never share noise (identical seeds would correlate the quantization error of all workers).
"""

import numpy as np

_MASK = (1 << 64) - 1


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def stream_seed(seed, rank, step, index):
    """A 63-bit seed for tensor ``index`` of worker ``rank`` at ``step``."""
    x = seed & _MASK
    for part in (rank, step, index):
        x = _splitmix64(x ^ (part & _MASK))
    return x >> 1


# lowbias32 (Chris Wellons, "Hash function prospector"): a bijective hash of 32-bit words in
# two multiply-xorshift rounds, the prospector's least biased of that shape.
_LOWBIAS32 = (0x7FEB352D, 0x846CA68B)
_MASK32 = 0xFFFFFFFF


def _lowbias32(x):
    x ^= x >> 16
    x *= np.uint32(_LOWBIAS32[0])
    x ^= x >> 15
    x *= np.uint32(_LOWBIAS32[1])
    return x ^ (x >> 16)


def key_words(key: int) -> tuple[int, int]:
    """(lo, multiplier): the 32-bit words of the stream ``key`` that ``uniforms`` hashes
    each counter with: the key's low word, and twice its high word plus one (odd, so that
    counter times multiplier is a bijection of 32-bit words)."""
    return key & _MASK32, (((key >> 32) << 1) | 1) & _MASK32


def uniforms(key: int, numel: int) -> np.ndarray:
    """Draws 0 .. numel - 1 of the stream ``key`` (a ``stream_seed``), float32 in [0, 1).

    Draw k is (h(k) >> 8) 2^-24 with h(k) = lowbias32(k m + lo) on 32-bit words (wrapping),
    (lo, m) the ``key_words``: a counter-based generator, so a kernel computes each draw
    where it uses it instead of reading a tensor of draws (which took as long to make as
    the rest of the encoding). Each key takes the counters along its own arithmetic
    progression, which lowbias32's two multiply-xorshift rounds then scramble; one round
    of hashing, not two, because the draws are a third of a quantizer's encoding time. For
    one key h is a bijection of the counter, so the 24-bit draws of a tensor (fewer than
    2^32 elements) never repeat a 32-bit state. Two keys with equal high words draw the
    same values shifted, at counters k and k + (lo - lo') / m modulo 2^32 (a 2^-31 chance
    for two stream seeds, and then shared only where both counters fall inside the
    tensor).

    Implemented once more in each place that draws, all giving the same numbers: torch ops
    (``hvd_compress.pt.seeding``), the CPU kernels (``hvd_compress.kernels``) and TensorFlow
    ops (``hvd_compress.tf.seeding``).
    """
    lo, multiplier = (np.uint32(word) for word in key_words(key))
    x = _lowbias32(np.arange(numel, dtype=np.uint32) * multiplier + lo)
    return (x >> 8).astype(np.float32) * np.float32(2.0**-24)
