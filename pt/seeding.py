"""``hvd_compress.seeding.uniforms`` in torch ops, for any device.

int64 tensors hold the 32-bit words: products of two of them wrap modulo 2^64, whose low 32
bits are the 32-bit product, kept by a mask; shifts of the masked, nonnegative words are the
logical shifts of the reference.
"""

import torch

from hvd_compress.seeding import _LOWBIAS32, _MASK32, key_words

# Draws made at a time on a CPU: the hash's dozen passes run over a buffer that stays
# in the cache, not over a tensor-sized one (6x faster on one thread for 25M draws). A GPU
# draws a whole tensor in one launch per operation.
_CPU_CHUNK = 1 << 17


def _lowbias32_(x, shifted):
    """lowbias32 of the words ``x``, in place; ``shifted`` is scratch of x's size."""
    for bits, multiplier in zip((16, 15), _LOWBIAS32):
        x ^= torch.bitwise_right_shift(x, bits, out=shifted)
        x.mul_(multiplier).bitwise_and_(_MASK32)
    x ^= torch.bitwise_right_shift(x, 16, out=shifted)
    return x


def _to_uniforms(x, scratch):
    """The draws of the hashed words ``x``: their top 24 bits over 2^24 (float32)."""
    return torch.bitwise_right_shift(x, 8, out=scratch).to(torch.float32).mul_(2.0**-24)


def stream_uniforms(
    counters: torch.Tensor, lo: torch.Tensor, multiplier: torch.Tensor
) -> torch.Tensor:
    """Draw ``counters[i]`` of the stream whose ``key_words`` are ``(lo[i],
    multiplier[i])``, for every i (int64 tensors alike): the draws of several streams in
    one pass, as a gradient bucket's members take them (``bucketing.BucketLayout``)."""
    x = counters * multiplier
    x.add_(lo).bitwise_and_(_MASK32)
    scratch = torch.empty_like(x)
    return _to_uniforms(_lowbias32_(x, scratch), scratch)


def uniforms(key: int, numel: int, device: torch.device) -> torch.Tensor:
    """Draws 0 .. numel - 1 of the stream ``key``, as ``hvd_compress.seeding.uniforms``."""
    lo, multiplier = key_words(key)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    chunk = _CPU_CHUNK if out.device.type == "cpu" else max(numel, 1)
    words = torch.empty(min(chunk, numel), dtype=torch.int64, device=device)
    shifted = torch.empty_like(words)
    for start in range(0, numel, chunk):
        stop = min(numel, start + chunk)
        x, scratch = torch.arange(start, stop, out=words[: stop - start]), shifted[: stop - start]
        _lowbias32_(x.mul_(multiplier).add_(lo).bitwise_and_(_MASK32), scratch)
        out[start:stop].copy_(torch.bitwise_right_shift(x, 8, out=scratch)).mul_(2.0**-24)
    return out
