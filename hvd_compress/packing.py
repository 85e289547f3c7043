"""Reference (numpy) packing of integer codes; the wire format is documented in ``codes.py``."""
import numpy as np

from .codes import IntCodes


def pack(codes, space: IntCodes):
    """Packs signed codes in [-bound, bound] along the last axis into ``uint8`` rows."""
    unsigned = codes.astype(np.int64) + space.bound
    width = space.width
    if width >= 8:
        dtype = np.dtype(f"<u{width // 8}")
        return np.ascontiguousarray(unsigned.astype(dtype)).view(np.uint8)
    per_byte = space.codes_per_byte
    numel = unsigned.shape[-1]
    padded = -(-numel // per_byte) * per_byte
    pad = [(0, 0)] * (unsigned.ndim - 1) + [(0, padded - numel)]
    unsigned = np.pad(unsigned, pad, constant_values=space.bound)
    groups = unsigned.reshape(*unsigned.shape[:-1], padded // per_byte, per_byte)
    shifts = np.arange(per_byte, dtype=np.int64) * width
    return (groups << shifts).sum(axis=-1).astype(np.uint8)


def unpack(packed, space: IntCodes, numel):
    """Inverse of ``pack``: the first ``numel`` signed codes of each row, as ``int32``."""
    width = space.width
    if width >= 8:
        dtype = np.dtype(f"<u{width // 8}")
        unsigned = np.ascontiguousarray(packed).view(dtype).astype(np.int64)
    else:
        per_byte = space.codes_per_byte
        shifts = np.arange(per_byte, dtype=np.int64) * width
        fields = (packed.astype(np.int64)[..., None] >> shifts) & ((1 << width) - 1)
        unsigned = fields.reshape(*packed.shape[:-1], -1)
    return (unsigned[..., :numel] - space.bound).astype(np.int32)
