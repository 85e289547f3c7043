"""Elias omega coding in PyTorch ops; mirrors ``hvd_compress.elias`` (format and method are
documented there). Runs on any device: only shifts, prefix sums and gathers."""

import torch

from hvd_compress.elias import CHUNK, MAX_DEPTH


def _bit_length(values):
    _, exponent = torch.frexp(values.to(torch.float64))
    return exponent.to(torch.int64)


def _out_of_range(values):
    return ((values < 1) | (values >= 2**32)).any()


def _range_error():
    return ValueError("Elias omega codes integers in [1, 2^32)")


def omega_codes(values):
    values = values.to(torch.int64)
    if bool(_out_of_range(values)):
        raise _range_error()
    return _omega_codes(values)


def _omega_codes(values):
    """``omega_codes`` without its range check, which ``encode`` reads with its sizes."""
    groups = [values]
    for _ in range(MAX_DEPTH - 1):
        groups.append(torch.clamp(_bit_length(groups[-1]) - 1, min=1))
    code = torch.zeros_like(values)
    length = torch.zeros_like(values)
    for group in reversed(groups):
        width = torch.where(group > 1, _bit_length(group), torch.zeros_like(group))
        code = torch.where(group > 1, (code << width) | group, code)
        length += width
    return code << 1, length + 1


def _packbits(bits):
    padded = torch.nn.functional.pad(bits.to(torch.int64), (0, -bits.numel() % 8))
    shifts = torch.arange(7, -1, -1, device=bits.device)
    return (padded.reshape(-1, 8) << shifts).sum(dim=1).to(torch.uint8)


def encode(codes):
    codes = codes.reshape(-1)
    # The payload's length depends on the codes and the host needs it to hand the payload to
    # the allgather: two reads of the device per tensor, the number of nonzeros here and the
    # sizes below.
    where = torch.nonzero(codes).reshape(-1)
    if where.numel() == 0:
        return torch.zeros(4, dtype=torch.uint8, device=codes.device)
    gaps = torch.diff(where, prepend=where.new_full((1,), -1))
    levels = codes[where].abs().to(torch.int64)
    gap_code, gap_len = _omega_codes(gaps)
    level_code, level_len = _omega_codes(levels)
    sign = (codes[where] < 0).to(torch.int64)
    symbols = torch.stack([gap_code, sign, level_code], dim=1).reshape(-1)
    lengths = torch.stack([gap_len, torch.ones_like(sign), level_len], dim=1).reshape(-1)
    ends = torch.cumsum(lengths, dim=0)
    starts = ends - lengths
    # One read: the bit count, the longest symbol (the loop's bound) and the range check.
    nbits, longest, out_of_range = torch.stack(
        [ends[-1], lengths.max(), (_out_of_range(gaps) | _out_of_range(levels)).to(torch.int64)]
    ).tolist()
    if out_of_range:
        raise _range_error()
    bits = torch.zeros(nbits, dtype=torch.int64, device=codes.device)
    for j in range(longest):
        # Symbols shorter than j + 1 bits add a 0 to their own last bit (no boolean masks,
        # which are slow on the CPU and force a device sync on a GPU).
        shift = torch.clamp(lengths - 1 - j, min=0)
        bit = ((symbols >> shift) & 1) * (j < lengths)
        bits.index_put_((starts + torch.clamp(lengths - 1, max=j),), bit, accumulate=True)
    offsets = starts[3 * CHUNK :: 3 * CHUNK]
    header = torch.cat([where.new_full((1,), where.numel()), offsets]).to(torch.int32)
    return torch.cat([header.view(torch.uint8), _packbits(bits)])


def _window(data, position):
    byte = torch.clamp(position >> 3, max=data.numel() - 5)
    window = torch.zeros_like(position)
    for j in range(5):
        window = (window << 8) | data[byte + j]
    return window


def _bits(window, position, width):
    return (window >> (40 - (position & 7) - width)) & ((1 << width) - 1)


def _omega(data, position):
    value = torch.ones_like(position)
    for _ in range(MAX_DEPTH):
        window = _window(data, position)
        more = _bits(window, position, 1) == 1
        # Once no value reads on, the rounds left change nothing. Stopping early saves them
        # on the CPU; on a GPU reading ``more`` would wait for the device in every round of
        # the decoder's loop, so there all rounds run.
        if position.device.type == "cpu" and not bool(more.any()):
            break
        width = torch.clamp(value + 1, max=32)
        value = torch.where(more, _bits(window, position, width), value)
        position = torch.where(more, position + width, position)
    return value, position + 1


def decode(data, numel):
    # clone: views need aligned storage. The one read of the device per payload: the number
    # of records sizes the decoding.
    count = int(data[:4].clone().view(torch.int32)[0])
    codes = torch.zeros(numel, dtype=torch.int32, device=data.device)
    if count == 0:
        return codes
    chunks = -(-count // CHUNK)
    header = 4 * chunks
    offsets = data[4:header].clone().view(torch.int32).to(torch.int64)
    cursor = torch.cat([offsets.new_zeros(1), offsets])
    stream = torch.cat([data[header:], data.new_zeros(5)]).to(torch.int64)
    records = torch.zeros((3, chunks, CHUNK), dtype=torch.int64, device=data.device)
    for i in range(CHUNK):
        gap, cursor = _omega(stream, cursor)
        sign = _bits(_window(stream, cursor), cursor, 1)
        level, cursor = _omega(stream, cursor + 1)
        records[0, :, i], records[1, :, i], records[2, :, i] = gap, sign, level
    gap, sign, level = records.reshape(3, -1)[:, :count]
    codes[torch.cumsum(gap, dim=0) - 1] = torch.where(sign == 1, -level, level).to(torch.int32)
    return codes
