"""Elias omega coding of QSGD codes (Alistarh et al., 2017, Section 3.2), vectorised.

A code vector travels as its nonzero entries only; each is a record of three symbols:

    omega(gap to the previous nonzero position, counting from 1)  sign bit  omega(|code|)

The bits are written most-significant first into bytes (``numpy.packbits`` order), after a
header of little-endian uint32s: the number of records, then the bit offset of every chunk of
``CHUNK`` records after the first.

omega(1) = "0"; for k > 1, omega(k) is binary(k) preceded by the groups binary(bitlength(k) - 1),
binary of that group's length - 1, ... down to a group of two or three bits, and followed by a
"0". Decoding starts with n = 1 and, while the next bit is 1, replaces n by the n + 1 bits there.

Encoding places every symbol's bits at once from the prefix sum of the symbol lengths. Decoding
is sequential within a chunk (each record starts where the previous one ends) but runs all
chunks side by side, so a vector of a million nonzeros takes CHUNK vectorised steps; the chunk
offsets cost 32 / CHUNK bits per nonzero.
"""

import numpy as np

MAX_DEPTH = 6  # omega groups of any integer below 2^32: k, <=31, <=4, <=2
CHUNK = 128  # records per independently decodable chunk


def _bit_length(values):
    """Bit length of positive int64 values."""
    _, exponent = np.frexp(values.astype(np.float64))
    return exponent.astype(np.int64)


def omega_codes(values):
    """Each positive integer's omega code as ``(bits, length)``, most significant bit first."""
    values = np.asarray(values, np.int64)
    if np.any(values < 1) or np.any(values >= 2**32):
        raise ValueError("Elias omega codes integers in [1, 2^32)")
    groups = [values]
    for _ in range(MAX_DEPTH - 1):
        groups.append(np.maximum(_bit_length(groups[-1]) - 1, 1))
    code = np.zeros_like(values)
    length = np.zeros_like(values)
    for group in reversed(groups):
        width = np.where(group > 1, _bit_length(group), 0)
        code = np.where(group > 1, (code << width) | group, code)
        length += width
    return code << 1, length + 1


def encode(codes):
    """The omega-coded bytes of an integer code vector (a uint8 array)."""
    codes = np.asarray(codes).ravel()
    where = np.flatnonzero(codes)
    if where.size == 0:
        return np.zeros(4, np.uint8)
    gap_code, gap_len = omega_codes(np.diff(where, prepend=-1))
    level_code, level_len = omega_codes(np.abs(codes[where]).astype(np.int64))
    sign = (codes[where] < 0).astype(np.int64)
    symbols = np.stack([gap_code, sign, level_code], axis=1).ravel()
    lengths = np.stack([gap_len, np.ones_like(sign), level_len], axis=1).ravel()
    ends = np.cumsum(lengths)
    starts = ends - lengths
    bits = np.zeros(int(ends[-1]), np.uint8)
    for j in range(int(lengths.max())):
        live = j < lengths
        bits[starts[live] + j] = (symbols[live] >> (lengths[live] - 1 - j)) & 1
    offsets = starts[3 * CHUNK :: 3 * CHUNK]
    header = np.concatenate([[where.size], offsets]).astype("<u4").view(np.uint8)
    return np.concatenate([header, np.packbits(bits)])


def _window(data, position):
    """The 40 bits of the byte array ``data`` from the byte holding each bit ``position``."""
    # Cursors of chunks that have run out of records may walk past the end: they read the
    # zero padding, and their results are dropped.
    byte = np.minimum(position >> 3, data.size - 5)
    window = np.zeros(position.shape, np.int64)
    for j in range(5):
        window = (window << 8) | data[byte + j]
    return window


def _bits(window, position, width):
    """``width`` (<= 32) bits at ``position`` out of its ``_window``."""
    return (window >> (40 - (position & 7) - width)) & ((1 << width) - 1)


def _omega(data, position):
    """The omega-coded values starting at ``position``, and the positions after them."""
    value = np.ones(position.shape, np.int64)
    for _ in range(MAX_DEPTH):
        window = _window(data, position)
        more = _bits(window, position, 1) == 1
        if not more.any():
            break
        width = np.minimum(value + 1, 32)
        value = np.where(more, _bits(window, position, width), value)
        position = np.where(more, position + width, position)
    return value, position + 1


def decode(data, numel):
    """Inverse of ``encode``: the int32 code vector of length ``numel``."""
    data = np.asarray(data, np.uint8)
    count = int(data[:4].view("<u4")[0])
    codes = np.zeros(numel, np.int32)
    if count == 0:
        return codes
    chunks = -(-count // CHUNK)
    header = 4 * chunks
    cursor = np.concatenate([[0], data[4:header].view("<u4")]).astype(np.int64)
    stream = np.concatenate([data[header:], np.zeros(5, np.uint8)]).astype(np.int64)
    records = np.zeros((3, chunks, CHUNK), np.int64)
    for i in range(CHUNK):
        gap, cursor = _omega(stream, cursor)
        sign = _bits(_window(stream, cursor), cursor, 1)
        level, cursor = _omega(stream, cursor + 1)
        records[:, :, i] = gap, sign, level
    gap, sign, level = records.reshape(3, -1)[:, :count]
    codes[np.cumsum(gap) - 1] = np.where(sign == 1, -level, level)
    return codes
