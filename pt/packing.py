"""PyTorch packing of codes; mirrors ``hvd_compress.packing`` (wire formats: ``codes.py``).

Only shifts, masks and sums of integer tensors: the same code runs on CPU and CUDA tensors.
"""
import torch

from hvd_compress.codes import FloatCodes, IntCodes, SignCodes


def pack(codes, space):
    """Packs codes along the last axis: ``uint8`` rows for ``IntCodes`` and ``SignCodes``,
    float16 for ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return codes.to(getattr(torch, space.dtype))
    if isinstance(space, SignCodes):
        return _pack_unsigned((codes < 0).to(torch.int64), 1, pad=0)
    return _pack_unsigned(codes.to(torch.int64) + space.bound, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row (``int32`` or float16)."""
    if isinstance(space, FloatCodes):
        return packed[..., :numel]
    if isinstance(space, SignCodes):
        return (1 - 2 * _unpack_unsigned(packed, 1, numel)).to(torch.int32)
    return (_unpack_unsigned(packed, space.width, numel) - space.bound).to(torch.int32)


def _pack_unsigned(unsigned, width, pad):
    device = unsigned.device
    if width >= 8:
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=device)
        fields = (unsigned.unsqueeze(-1) >> shifts) & 0xFF
        return fields.reshape(*unsigned.shape[:-1], -1).to(torch.uint8)
    per_byte = 8 // width
    numel = unsigned.shape[-1]
    padded = -(-numel // per_byte) * per_byte
    unsigned = torch.nn.functional.pad(unsigned, (0, padded - numel), value=pad)
    groups = unsigned.reshape(*unsigned.shape[:-1], padded // per_byte, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int64, device=device) * width
    return (groups << shifts).sum(dim=-1).to(torch.uint8)


def _unpack_unsigned(packed, width, numel):
    device = packed.device
    if width >= 8:
        fields = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, width // 8)
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=device)
        unsigned = (fields << shifts).sum(dim=-1)
    else:
        shifts = torch.arange(8 // width, dtype=torch.int64, device=device) * width
        fields = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << width) - 1)
        unsigned = fields.reshape(*packed.shape[:-1], -1)
    return unsigned[..., :numel]


__all__ = ["pack", "unpack", "IntCodes", "FloatCodes", "SignCodes"]
