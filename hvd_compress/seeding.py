"""Counter-based seeds: every (rank, step, tensor) draws from its own random stream.

A stream is a pure function of its coordinates, so a run can be replayed (tests feed the same
draws to the numpy reference), resumed from a checkpoint that stores only the step, and ranks
never share noise (identical seeds would correlate the quantization error of all workers).
"""
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
