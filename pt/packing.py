"""PyTorch packing of codes; mirrors ``hvd_compress.packing`` (wire formats: ``codes.py``).

Only shifts, masks and sums of integer tensors: the same code runs on CPU and CUDA tensors.
"""
import torch

from hvd_compress.codes import WIDTHS, FieldCodes, FloatCodes, IntCodes, SignCodes


def pack(codes, space):
    """Packs codes along the last axis: ``uint8`` rows for ``IntCodes``, ``SignCodes`` and
    ``FieldCodes``, float16 for ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return codes.to(getattr(torch, space.dtype))
    if isinstance(space, FieldCodes):
        return _pack_unsigned(codes.to(torch.int64), space.width, pad=0)
    if isinstance(space, SignCodes):
        return _pack_unsigned((codes < 0).to(torch.int64), 1, pad=0)
    return _pack_unsigned(codes.to(torch.int64) + space.bound, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row (``int32``, ``int64`` for
    ``FieldCodes``, or float16)."""
    if isinstance(space, FloatCodes):
        return packed[..., :numel]
    if isinstance(space, FieldCodes):
        return _unpack_unsigned(packed, space.width, numel)
    if isinstance(space, SignCodes):
        return (1 - 2 * _unpack_unsigned(packed, 1, numel)).to(torch.int32)
    return (_unpack_unsigned(packed, space.width, numel) - space.bound).to(torch.int32)


def _pack_unsigned(unsigned, width, pad):
    device = unsigned.device
    if width not in WIDTHS:
        return _pack_bits(unsigned, width)
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
    if width not in WIDTHS:
        return _unpack_bits(packed, width, numel)
    if width >= 8:
        fields = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, width // 8)
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=device)
        unsigned = (fields << shifts).sum(dim=-1)
    else:
        shifts = torch.arange(8 // width, dtype=torch.int64, device=device) * width
        fields = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << width) - 1)
        unsigned = fields.reshape(*packed.shape[:-1], -1)
    return unsigned[..., :numel]


def _bit_shifts(width, device):
    return torch.arange(width, dtype=torch.int64, device=device)


def _pack_bits(unsigned, width):
    """Fields of any width as one little-endian bit stream per row (``codes.FieldCodes``)."""
    bits = (unsigned.unsqueeze(-1) >> _bit_shifts(width, unsigned.device)) & 1
    bits = bits.reshape(*unsigned.shape[:-1], -1)
    bits = torch.nn.functional.pad(bits, (0, -bits.shape[-1] % 8))
    octets = bits.reshape(*bits.shape[:-1], -1, 8) << _bit_shifts(8, unsigned.device)
    return octets.sum(dim=-1).to(torch.uint8)


def _unpack_bits(packed, width, numel):
    bits = (packed.to(torch.int64).unsqueeze(-1) >> _bit_shifts(8, packed.device)) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :numel * width]
    fields = bits.reshape(*packed.shape[:-1], numel, width)
    return (fields << _bit_shifts(width, packed.device)).sum(dim=-1)


__all__ = ["pack", "unpack", "FieldCodes", "IntCodes", "FloatCodes", "SignCodes"]
