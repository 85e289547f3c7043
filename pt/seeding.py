"""``hvd_compress.seeding.uniforms`` in torch ops, for any device.

int64 tensors hold the 32-bit words: products of two of them wrap modulo 2^64, whose low 32
bits are the 32-bit product, kept by a mask; shifts of the masked, nonnegative words are the
logical shifts of the reference.
"""
import torch

from hvd_compress.seeding import _LOWBIAS32, _MASK32, key_words


def _lowbias32_(x):
    x ^= x >> 16
    x.mul_(_LOWBIAS32[0]).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_LOWBIAS32[1]).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def uniforms(key: int, numel: int, device: torch.device) -> torch.Tensor:
    """Draws 0 .. numel - 1 of the stream ``key``, as ``hvd_compress.seeding.uniforms``."""
    lo, hi = key_words(key)
    x = _lowbias32_(_lowbias32_(torch.arange(numel, dtype=torch.int64, device=device) ^ lo) ^ hi)
    return (x >> 8).to(torch.float32).mul_(2.0 ** -24)
