"""PyTorch packing of codes; mirrors ``hvd_compress.packing`` (wire formats: ``codes.py``).

Only shifts, masks, sums, products and table lookups of integer tensors, and views of
their bytes: the same code runs on CPU and CUDA tensors.
"""

import functools

import torch

from hvd_compress.codes import WIDTHS, FieldCodes, FloatCodes, IntCodes, SignCodes


def pack(codes, space):
    """Packs codes along the last axis: ``uint8`` rows for ``IntCodes``, ``SignCodes`` and
    ``FieldCodes``, float16 for ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return codes.to(getattr(torch, space.dtype))
    if isinstance(space, FieldCodes):
        return _pack_unsigned(codes, space.width, pad=0)
    if isinstance(space, SignCodes):
        # A sign's bit (1 for -1) is an int8 code's sign bit: a shift, not a comparison.
        negative = codes.view(torch.uint8) >> 7 if codes.dtype == torch.int8 else codes < 0
        return _pack_unsigned(negative, 1, pad=0)
    if space.width <= 8:
        # code + bound in uint8 arithmetic, which is modulo 256: exact, as the sum is at
        # most 2 bound < 256 (and int8, int32 or int64 codes convert modulo 256 too).
        unsigned = codes.to(torch.uint8, copy=True).add_(space.bound)
    else:
        unsigned = codes.to(torch.int64) + space.bound
    return _pack_unsigned(unsigned, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row: ``int8`` for signs and
    for codes of at most 8 bits (consumers convert them once, to what they compute in),
    ``int32`` for wider ones, ``int64`` for ``FieldCodes``, float16 for ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return packed[..., :numel]
    if isinstance(space, FieldCodes):
        return _unpack_unsigned(packed, space.width, numel).to(torch.int64)
    if isinstance(space, SignCodes):
        # A set bit is -1, a clear one +1.
        return _split_bytes(packed, 1, numel, multiplier=-2, offset=1)
    if space.width < 8:
        return _split_bytes(packed, space.width, numel, offset=-space.bound)
    unsigned = _unpack_unsigned(packed, space.width, numel)
    if space.width == 8:
        # unsigned - bound modulo 256, read as int8: the code, as |code| <= bound < 128.
        return unsigned.sub_(space.bound).view(torch.int8)
    return (unsigned - space.bound).to(torch.int32)


def _pack_unsigned(unsigned, width, pad):
    """Unsigned fields of ``width`` bits packed little-endian: fields narrower than a byte
    merged by ``_merge_fields``, wider ones split into bytes in int64."""
    device = unsigned.device
    if width not in WIDTHS:
        return _pack_bits(unsigned.to(torch.int64), width)
    if width == 8:
        return unsigned.to(torch.uint8)
    if width > 8:
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=device)
        fields = (unsigned.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF
        return fields.reshape(*unsigned.shape[:-1], -1).to(torch.uint8)
    per_byte = 8 // width
    unsigned = unsigned.to(torch.uint8)
    numel = unsigned.shape[-1]
    if numel % per_byte:
        unsigned = torch.nn.functional.pad(unsigned, (0, -numel % per_byte), value=pad)
    return _merge_fields(unsigned.contiguous(), width)


# Fields of 2 and 4 bits are merged a few bytes at a time, as the bytes of one integer
# word: shifts, ors and masks of whole contiguous words instead of one strided pass per
# field. Words of at most 32 bits: x86 has no vector arithmetic shift of 64-bit
# integers. A word's bytes are read little-endian, the byte order of the CPUs and GPUs
# PyTorch runs on, and the wire format's order of fields within a byte.
_WORDS = {2: torch.int16, 4: torch.int32}


# One-bit fields are merged by one multiplication per eight of them: field i of an int64
# word (bit 8 i) times 2^(56 - 7 i) lands on bit 56 + i, the other 56 partial products
# fall on distinct bits below 56 or wrap away above 63, so nothing carries into the top
# byte. Twice as fast on a CPU as the doubling runs, which remain for 2 and 4 bits.
_GATHER_BITS = 0x0102040810204080


def _merge_fields(fields, width):
    """uint8 ``fields`` of ``width`` bits (last axis a multiple of 8 // width), merged
    little-endian into bytes."""
    if fields.numel() == 0:  # an empty tensor's strides may not allow a view
        return fields.new_empty(*fields.shape[:-1], fields.shape[-1] * width // 8)
    if width == 1:
        return ((fields.view(torch.int64) * _GATHER_BITS) >> 56).to(torch.uint8)
    while width < 8:
        per_word = min(8 // width, 4)
        words = fields.view(_WORDS[per_word])
        # Doubling runs: each step moves the upper half of every run next to its lower half.
        run = 1
        while run < per_word:
            words = words | (words >> (run * (8 - width)))
            run *= 2
        fields, width = words.to(torch.uint8), width * per_word
    return fields


# Fields narrower than a byte are split by table lookup: row b of a byte table holds the
# 8 // width fields of byte b as int8 values, and all of them together as one integer word,
# so one gather of words per packed byte writes them all (5x faster on a CPU than splitting
# with shifts and masks).
_BYTE_WORDS = {1: torch.int64, 2: torch.int32, 4: torch.int16}


@functools.cache
def _byte_table(width, multiplier, offset, device):
    per_byte = 8 // width
    shifts = width * torch.arange(per_byte)
    fields = (torch.arange(256).unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    values = (multiplier * fields + offset).to(torch.int8)
    return values.view(_BYTE_WORDS[width]).reshape(256).to(device)


def _split_bytes(packed, width, numel, multiplier=1, offset=0):
    """The first ``numel`` fields f of ``width`` < 8 bits of each row of ``packed``, each as
    the int8 ``multiplier * f + offset``, in a new tensor."""
    table = _byte_table(width, multiplier, offset, packed.device)
    words = table.index_select(0, packed.reshape(-1).to(torch.int32))
    return words.view(torch.int8).reshape(*packed.shape[:-1], -1)[..., :numel]


@functools.cache
def _sign_table(device):
    """Row b: the eight signs of byte b as float32, as ``unpack`` reads them."""
    return _byte_table(1, -2, 1, device).view(torch.int8).reshape(256, 8).to(torch.float32)


def unpack_scaled_signs(packed, scale, numel):
    """The first ``numel`` signs (``SignCodes``) of each row of ``packed`` times that row's
    ``scale`` (one per row), as float32; NaN for a non-finite scale, as ``rescale`` gives.

    One gather of eight floats per packed byte from a table of each row's two values, in
    place of unpacking to int8, converting to float32 and scaling: 33 against 42 ms for the
    sharded server's 4 x 6.4M signs on one CPU thread. Exact: each value is +-scale."""
    rows = packed.shape[0]
    scale = scale.to(torch.float32).reshape(rows, 1, 1)
    scale = torch.where(torch.isfinite(scale), scale, float("nan"))
    tables = (_sign_table(packed.device) * scale).reshape(rows * 256, 8)
    offsets = 256 * torch.arange(rows, dtype=torch.int32, device=packed.device).unsqueeze(1)
    index = packed.to(torch.int32) + offsets
    return tables.index_select(0, index.reshape(-1)).reshape(rows, -1)[:, :numel]


def _unpack_unsigned(packed, width, numel):
    """The first ``numel`` fields of each row, as a new tensor: uint8 for widths up to a
    byte, int64 above."""
    device = packed.device
    if width not in WIDTHS:
        return _unpack_bits(packed, width, numel)
    if width == 8:
        return packed[..., :numel].clone()
    if width > 8:
        fields = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, width // 8)
        shifts = torch.arange(0, width, 8, dtype=torch.int64, device=device)
        return (fields << shifts).sum(dim=-1)[..., :numel]
    return _split_bytes(packed, width, numel).view(torch.uint8)


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
    bits = bits.reshape(*packed.shape[:-1], -1)[..., : numel * width]
    fields = bits.reshape(*packed.shape[:-1], numel, width)
    return (fields << _bit_shifts(width, packed.device)).sum(dim=-1)


__all__ = ["pack", "unpack", "FieldCodes", "IntCodes", "FloatCodes", "SignCodes"]
