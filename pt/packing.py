"""PyTorch packing of codes; mirrors ``hvd_compress.packing`` (wire format: ``codes.py``).

Only shifts, masks and sums of integer tensors: the same code runs on CPU and CUDA tensors.
"""
import torch

from hvd_compress.codes import FloatCodes, IntCodes


def pack(codes, space):
    """Packs codes along the last axis: ``uint8`` rows for ``IntCodes``, float16 for
    ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return codes.to(getattr(torch, space.dtype))
    unsigned = codes.to(torch.int64) + space.bound
    width = space.width
    if width >= 8:
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=codes.device)
        fields = (unsigned.unsqueeze(-1) >> shifts) & 0xFF
        return fields.reshape(*codes.shape[:-1], -1).to(torch.uint8)
    per_byte = space.codes_per_byte
    numel = unsigned.shape[-1]
    padded = -(-numel // per_byte) * per_byte
    unsigned = torch.nn.functional.pad(unsigned, (0, padded - numel), value=space.bound)
    groups = unsigned.reshape(*unsigned.shape[:-1], padded // per_byte, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int64, device=codes.device) * width
    return (groups << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row (``int32`` or float16)."""
    if isinstance(space, FloatCodes):
        return packed[..., :numel]
    width = space.width
    if width >= 8:
        fields = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, width // 8)
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=packed.device)
        unsigned = (fields << shifts).sum(dim=-1)
    else:
        per_byte = space.codes_per_byte
        shifts = torch.arange(per_byte, dtype=torch.int64, device=packed.device) * width
        fields = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << width) - 1)
        unsigned = fields.reshape(*packed.shape[:-1], -1)
    return (unsigned[..., :numel] - space.bound).to(torch.int32)


__all__ = ["pack", "unpack", "IntCodes", "FloatCodes"]
