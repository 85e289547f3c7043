"""Reference (numpy) packing of codes; the wire formats are documented in ``codes.py``."""
import numpy as np

from .codes import IntCodes, SignCodes


def pack(codes, space):
    """Packs codes along the last axis into ``uint8`` rows: integers in [-bound, bound] for
    ``IntCodes``, signs -1/+1 for ``SignCodes``."""
    if isinstance(space, SignCodes):
        return _pack_unsigned((codes < 0).astype(np.int64), 1, pad=0)
    return _pack_unsigned(codes.astype(np.int64) + space.bound, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row, as ``int32``."""
    if isinstance(space, SignCodes):
        return (1 - 2 * _unpack_unsigned(packed, 1, numel)).astype(np.int32)
    return (_unpack_unsigned(packed, space.width, numel) - space.bound).astype(np.int32)


def _pack_unsigned(unsigned, width, pad):
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
    if width >= 8:
        dtype = np.dtype(f"<u{width // 8}")
        unsigned = np.ascontiguousarray(packed).view(dtype).astype(np.int64)
    else:
        per_byte = 8 // width
        shifts = np.arange(per_byte, dtype=np.int64) * width
        fields = (packed.astype(np.int64)[..., None] >> shifts) & ((1 << width) - 1)
        unsigned = fields.reshape(*packed.shape[:-1], -1)
    return unsigned[..., :numel]


__all__ = ["pack", "unpack", "IntCodes", "SignCodes"]
