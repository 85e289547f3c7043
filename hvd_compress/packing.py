"""Reference (numpy) packing of codes; the wire formats are documented in ``codes.py``."""

import numpy as np

from .codes import WIDTHS, FieldCodes, IntCodes, SignCodes


def pack(codes, space):
    """Packs codes along the last axis into ``uint8`` rows: integers in [-bound, bound] for
    ``IntCodes``, signs -1/+1 for ``SignCodes``, integers in [0, 2^width) for ``FieldCodes``."""
    if isinstance(space, FieldCodes):
        return _pack_unsigned(codes.astype(np.int64), space.width, pad=0)
    if isinstance(space, SignCodes):
        return _pack_unsigned((codes < 0).astype(np.int64), 1, pad=0)
    return _pack_unsigned(codes.astype(np.int64) + space.bound, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row, as ``int32`` (``int64``
    for ``FieldCodes``)."""
    if isinstance(space, FieldCodes):
        return _unpack_unsigned(packed, space.width, numel)
    if isinstance(space, SignCodes):
        return (1 - 2 * _unpack_unsigned(packed, 1, numel)).astype(np.int32)
    return (_unpack_unsigned(packed, space.width, numel) - space.bound).astype(np.int32)


def _pack_unsigned(unsigned, width, pad):
    if width not in WIDTHS:
        return _pack_bits(unsigned, width)
    if width >= 8:
        dtype = np.dtype(f"<u{width // 8}")
        return np.ascontiguousarray(unsigned.astype(dtype)).view(np.uint8)
    per_byte = 8 // width
    numel = unsigned.shape[-1]
    padded = -(-numel // per_byte) * per_byte
    widths = [(0, 0)] * (unsigned.ndim - 1) + [(0, padded - numel)]
    unsigned = np.pad(unsigned, widths, constant_values=pad)
    groups = unsigned.reshape(*unsigned.shape[:-1], padded // per_byte, per_byte)
    shifts = np.arange(per_byte, dtype=np.int64) * width
    return (groups << shifts).sum(axis=-1).astype(np.uint8)


def _unpack_unsigned(packed, width, numel):
    if width not in WIDTHS:
        return _unpack_bits(packed, width, numel)
    if width >= 8:
        dtype = np.dtype(f"<u{width // 8}")
        unsigned = np.ascontiguousarray(packed).view(dtype).astype(np.int64)
    else:
        per_byte = 8 // width
        shifts = np.arange(per_byte, dtype=np.int64) * width
        fields = (packed.astype(np.int64)[..., None] >> shifts) & ((1 << width) - 1)
        unsigned = fields.reshape(*packed.shape[:-1], -1)
    return unsigned[..., :numel]


def _pack_bits(unsigned, width):
    """Fields of any width as one little-endian bit stream per row (``codes.FieldCodes``)."""
    bits = (unsigned[..., None] >> np.arange(width, dtype=np.int64)) & 1
    bits = bits.reshape(*unsigned.shape[:-1], -1).astype(np.uint8)
    return np.packbits(bits, axis=-1, bitorder="little")


def _unpack_bits(packed, width, numel):
    bits = np.unpackbits(packed, axis=-1, count=numel * width, bitorder="little")
    fields = bits.astype(np.int64).reshape(*packed.shape[:-1], numel, width)
    return (fields << np.arange(width, dtype=np.int64)).sum(axis=-1)


__all__ = ["pack", "unpack", "FieldCodes", "IntCodes", "SignCodes"]
