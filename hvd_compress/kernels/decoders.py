"""The quantizers' receiving side: each row's fixed-width codes (``codes.IntCodes``)
unpacked, summed and decoded with its scales, a chunk (``base.CHUNK``) of elements at a
time, as ef-sign's server decodes its signs.
"""

import numpy as np

from .base import CHUNK, decoded_scale, jit
from .quantizers import nuqsgd_value, pack_chunk


@jit
def _pack_any(codes, bound, width, fields, packed):
    """``codes`` packed for every width of ``codes.IntCodes``: through the chunk buffer
    ``fields`` for 2, 4 and 8 bits, 16 and 32 bits little-endian."""
    if width <= 8:
        for i in range(codes.size):
            fields[i] = codes[i] + bound
        pack_chunk(fields, codes.size, bound, width, packed)
        return
    nbytes = width // 8
    for i in range(codes.size):
        field = codes[i] + bound
        for t in range(nbytes):
            packed[nbytes * i + t] = (field >> (8 * t)) & 0xFF


@jit(inline="always")
def _field_value(field, bound, nuqsgd):
    """The value of a packed field: its code, field - bound, or with ``nuqsgd`` that code's
    ``NUQSGD.values``."""
    code = np.int32(field) - bound
    return nuqsgd_value(code) if nuqsgd else code


# The receiving side unpacks a chunk of a row into a field per byte first, four (2 bits) or
# two (4 bits) from each byte by constant shifts into one word, as ``_pack_fields`` packs
# them; the loops that add or decode the values then run over contiguous fields. Both
# vectorize, where one loop over the row's bytes storing each byte's fields four elements
# apart vectorizes poorly (it took 1.5x the time of the two for 2-bit codes).


@jit
def _unpack_fields(row, width, count, fields):
    """The first ``count`` fields of the packed ``row`` (``codes.IntCodes`` of 2, 4 or 8
    bits, field 0 at a byte's start), one per byte, into ``fields`` (``CHUNK`` bytes)."""
    if width == 2:
        words = fields.view(np.uint32)
        for j in range(-(-count // 4)):
            byte = np.uint32(row[j])
            words[j] = (
                (byte & np.uint32(0x3))
                | ((byte & np.uint32(0xC)) << np.uint32(6))
                | ((byte & np.uint32(0x30)) << np.uint32(12))
                | ((byte & np.uint32(0xC0)) << np.uint32(18))
            )
    elif width == 4:
        halves = fields.view(np.uint16)
        for j in range(-(-count // 2)):
            byte = np.uint16(row[j])
            halves[j] = (byte & np.uint16(0xF)) | ((byte & np.uint16(0xF0)) << np.uint16(4))
    else:
        for j in range(count):
            fields[j] = row[j]


@jit(inline="always")
def _add_values(fields, bound, nuqsgd, acc):
    for i in range(acc.size):
        acc[i] += _field_value(fields[i], bound, nuqsgd)


@jit
def _add_fields(row, width, bound, nuqsgd, fields, acc):
    """acc[i] += the value of field i of the packed ``row`` (``_field_value``): codes of 2,
    4 or 8 bits, unpacked through the scratch ``fields``."""
    _unpack_fields(row, width, acc.size, fields)
    # One inlined copy per kind of value.
    if nuqsgd:
        _add_values(fields, np.int32(bound), True, acc)
    else:
        _add_values(fields, np.int32(bound), False, acc)


@jit(error_model="numpy")
def _decoded(total, divisor, scale, out):
    for i in range(total.size):
        out[i] = np.float32(total[i]) * scale / divisor


@jit
def _decode(total, first, scale, bucket, divisor, out):
    """out (elements first .. first + total.size) = ``Codec.decode`` of ``total``: total
    scale[b] / divisor in float32, NaN where scale[b] is not finite."""
    position, stop = first, first + total.size
    while position < stop:
        b = position // bucket
        end = min(stop, (b + 1) * bucket)
        scale_b = decoded_scale(scale[b])
        piece = slice(position - first, end - first)
        _decoded(total[piece], divisor, scale_b, out[piece])
        position = end


@jit
def decoded_totals(total, scale, bucket, divisor, out):
    """The allreduce's decode: out = ``Codec.decode`` of the summed values ``total``."""
    _decode(total, 0, scale, bucket, np.float32(divisor), out)


@jit
def summed_codes(rows, width, bound, nuqsgd, length, total_bound, total_width, out):
    """The sharded exchange's sum: the values (``_field_value``) of the first ``length``
    codes of each row of ``rows`` (``width``-bit ``IntCodes(bound)``) summed over the rows
    in int32 and packed into ``out`` at ``total_width`` bits (``IntCodes(total_bound)``)."""
    sums = np.empty(CHUNK, dtype=np.int32)
    fields = np.empty(CHUNK, dtype=np.uint8)
    for start in range(0, length, CHUNK):
        chunk = sums[: min(length, start + CHUNK) - start]
        chunk[:] = 0
        for r in range(rows.shape[0]):
            _add_fields(rows[r, start * width // 8 :], width, bound, nuqsgd, fields, chunk)
        _pack_any(chunk, total_bound, total_width, fields, out[start * total_width // 8 :])


@jit(inline="always", error_model="numpy")
def _scaled_values(fields, bound, nuqsgd, partial, scale, divisor, add, out):
    # A loop of its own per kind of output, which LLVM vectorizes (a test of the kind inside
    # one loop keeps it from vectorizing some).
    if add:
        for i in range(out.size):
            out[i] += np.float32(_field_value(fields[i], bound, nuqsgd)) * scale / divisor
    elif partial.size:
        for i in range(out.size):
            value = _field_value(fields[i], bound, nuqsgd)
            out[i] = np.float32(value + partial[i]) * scale / divisor
    else:
        for i in range(out.size):
            out[i] = np.float32(_field_value(fields[i], bound, nuqsgd)) * scale / divisor


@jit(inline="always", error_model="numpy")
def _scaled_fields(fields, bound, nuqsgd, partial, scale, divisor, add, out):
    """out = or += the decode under ``scale`` / ``divisor`` of the values of ``fields`` (plus
    ``partial``'s, if it is not empty)."""
    # One inlined copy per kind of value.
    if nuqsgd:
        _scaled_values(fields, bound, True, partial, scale, divisor, add, out)
    else:
        _scaled_values(fields, bound, False, partial, scale, divisor, add, out)


@jit(error_model="numpy")
def _decoded_wide(row, width, bound, scale, divisor, out):
    """out = the decode of the 16- or 32-bit sums of ``row``."""
    # A loop per width, each field's bytes assembled by constant shifts, which LLVM
    # vectorizes (a loop over each field's bytes it does not).
    if width == 16:
        for i in range(out.size):
            field = np.int32(row[2 * i]) | np.int32(row[2 * i + 1]) << 8
            out[i] = np.float32(field - bound) * scale / divisor
    else:
        for i in range(out.size):
            field = (
                np.int64(row[4 * i])
                | np.int64(row[4 * i + 1]) << 8
                | np.int64(row[4 * i + 2]) << 16
                | np.int64(row[4 * i + 3]) << 24
            )
            out[i] = np.float32(field - bound) * scale / divisor


@jit(error_model="numpy")
def _decode_row(
    row, width, bound, nuqsgd, partial, first, scale, bucket, divisor, add, fields, out
):
    """out (elements first .. first + out.size; field 0 of ``row`` is element first, on a
    byte boundary) = or += ``Codec.decode`` of partial + the values of row's fields, under
    scale[b] for bucket b (NaN where it is not finite); ``fields`` a chunk's scratch."""
    bound = np.int32(bound)
    if width > 8:
        if add or partial.size or nuqsgd:
            raise ValueError("width: only sums of codes have 16 or 32 bits")
        position, stop = first, first + out.size
        while position < stop:
            b = position // bucket
            end = min(stop, (b + 1) * bucket)
            lo, hi = position - first, end - first
            scale_b = decoded_scale(scale[b])
            _decoded_wide(row[lo * width // 8 :], width, bound, scale_b, divisor, out[lo:hi])
            position = end
        return
    for start in range(0, out.size, CHUNK):
        count = min(out.size - start, CHUNK)
        _unpack_fields(row[start * width // 8 :], width, count, fields)
        position, stop = first + start, first + start + count
        while position < stop:
            b = position // bucket
            end = min(stop, (b + 1) * bucket)
            lo, hi = position - first, end - first
            _scaled_fields(
                fields[lo - start : hi - start],
                bound,
                nuqsgd,
                partial[lo:hi] if partial.size else partial,
                decoded_scale(scale[b]),
                divisor,
                add,
                out[lo:hi],
            )
            position = end


@jit
def decoded_sums(rows, width, bound, nuqsgd, scale, bucket, divisor, out):
    """The allgather's decode under a shared scale: out = decode of the sum over rows of
    the values of their first out.size codes."""
    sums = np.empty(CHUNK, dtype=np.int32)
    fields = np.empty(CHUNK, dtype=np.uint8)
    divisor = np.float32(divisor)
    last = rows.shape[0] - 1
    for start in range(0, out.size, CHUNK):
        stop = min(out.size, start + CHUNK)
        chunk = sums[: stop - start] if last else sums[:0]
        chunk[:] = 0
        for r in range(last):
            _add_fields(rows[r, start * width // 8 :], width, bound, nuqsgd, fields, chunk)
        _decode_row(
            rows[last, start * width // 8 :],
            width,
            bound,
            nuqsgd,
            chunk,
            start,
            scale,
            bucket,
            divisor,
            False,
            fields,
            out[start:stop],
        )


@jit
def decoded_own_scales(rows, width, bound, nuqsgd, scales, bucket, divisor, out):
    """The allgather's decode under each worker's own scales (row r of ``scales``): out =
    the sum over rows, in order, of the decoded values of their first out.size codes."""
    none = np.empty(0, dtype=np.int32)
    fields = np.empty(CHUNK, dtype=np.uint8)
    divisor = np.float32(divisor)
    # A chunk at a time, so that each row adds to a piece of ``out`` still in the cache.
    for start in range(0, out.size, CHUNK):
        stop = min(out.size, start + CHUNK)
        for r in range(rows.shape[0]):
            row = rows[r, start * width // 8 :]
            _decode_row(
                row,
                width,
                bound,
                nuqsgd,
                none,
                start,
                scales[r],
                bucket,
                divisor,
                r > 0,
                fields,
                out[start:stop],
            )


@jit
def decoded_segments(rows, width, bound, length, scale, bucket, divisor, out):
    """The sharded exchange's decode: row r holds the summed values of elements
    r length .. (r + 1) length - 1, decoded into ``out`` (cut at out.size)."""
    none = np.empty(0, dtype=np.int32)
    fields = np.empty(CHUNK, dtype=np.uint8)
    divisor = np.float32(divisor)
    for r in range(rows.shape[0]):
        first = r * length
        valid = max(0, min(length, out.size - first))
        _decode_row(
            rows[r],
            width,
            bound,
            False,
            none,
            first,
            scale,
            bucket,
            divisor,
            False,
            fields,
            out[first : first + valid],
        )
