"""ef-sign's (dist-EF-blockSGD's) sign codes: the worker's signs and residual, and the
receiving side's decoded, averaged and compensated rows with their block sums.
"""

import numpy as np

from .base import CHUNK, decoded_scale, jit

# A block's signs and residual go a piece at a time, in three passes over the piece while it
# is in the cache, each a loop alone in a function: a flag byte per element, the flags
# packed eight to a byte from whole words, then the residual. One loop that packed each
# byte from its eight elements and wrote their residuals LLVM did not vectorize: it took
# twice the time of a pass that reads and writes p.
_SIGN_PIECE = 16384  # elements


@jit
def _negative_flags(p, flags):
    for i in range(p.size):
        flags[i] = not p[i] >= 0


@jit
def _packed_flags(flags, count, packed):
    """The first ``count`` of ``flags`` (bytes of 0 or 1) packed into ``packed``, flag k
    of a byte its bit k (``codes.SignCodes``); the free bits of a last partial byte 0."""
    words = flags.view(np.uint64)
    for j in range(count // 8):
        # A word's eight flags sit at bits 0, 8, ..., 56: fold them onto bits 0 to 7.
        w = words[j]
        w = (w | (w >> np.uint64(7))) & np.uint64(0x0003000300030003)
        w = (w | (w >> np.uint64(14))) & np.uint64(0x0000000F0000000F)
        packed[j] = (w | (w >> np.uint64(28))) & np.uint64(0xFF)
    if count % 8:
        byte = 0
        for i in range(count - count % 8, count):
            byte |= flags[i] << (i % 8)
        packed[count // 8] = byte


@jit
def _pack_signs(p, packed, flags):
    """The signs of ``p`` packed into ``packed`` (``codes.SignCodes``), a piece at a time
    through ``flags`` (``_SIGN_PIECE`` bytes of scratch)."""
    for start in range(0, p.size, _SIGN_PIECE):
        stop = min(p.size, start + _SIGN_PIECE)
        _negative_flags(p[start:stop], flags)
        _packed_flags(flags, stop - start, packed[start // 8 :])


@jit(inline="always")
def _residual(p, s, residual):
    for i in range(p.size):
        residual[i] = p[i] - (s if p[i] >= 0 else -s)


# Each loop over elements is compiled twice, into a new residual and over p itself: given
# the same array twice, LLVM's test for overlapping arrays sends the loop down its scalar
# path (3x slower), where the array passed once is a loop it vectorizes.


@jit
def _block_residual(p, s, residual):
    _residual(p, s, residual)


@jit
def _block_residual_in_place(p, s):
    _residual(p, s, p)


@jit
def _block_signs(p, s, packed, residual, flags):
    """``signs_with_feedback`` of one block that starts on a byte boundary, reading p once
    from memory (``flags``: ``_SIGN_PIECE`` bytes of scratch)."""
    for start in range(0, p.size, _SIGN_PIECE):
        stop = min(p.size, start + _SIGN_PIECE)
        _pack_signs(p[start:stop], packed[start // 8 :], flags)
        if residual.size:
            _block_residual(p[start:stop], s, residual[start:stop])
        else:
            _block_residual_in_place(p[start:stop], s)


@jit
def signs_with_feedback(p, scale, block, packed, residual):
    """One BlockSign message with error feedback: the packed signs of ``p`` and the
    residual p - sign(p) scale[b] of each block b (NaN where the scale is not finite, as
    the eager decode gives), into ``residual``, or over p itself if ``residual`` is empty.
    ``packed`` holds at least ceil(p.size / 8) bytes; the bits of a last partial byte past
    p.size are 0 (+1, cut off by every receiver)."""
    # Every block starts on a byte boundary, or some share a byte.
    aligned = block % 8 == 0 or scale.size == 1
    flags = np.empty(_SIGN_PIECE, dtype=np.uint8)
    if not aligned:  # before p becomes the residual
        _pack_signs(p, packed, flags)
    in_place = residual.size == 0
    for b in range(scale.size):
        s = decoded_scale(scale[b])
        start, stop = b * block, min(p.size, (b + 1) * block)
        if aligned:
            kept = residual if in_place else residual[start:stop]
            _block_signs(p[start:stop], s, packed[start // 8 :], kept, flags)
        elif in_place:
            _block_residual_in_place(p[start:stop], s)
        else:
            _block_residual(p[start:stop], s, residual[start:stop])


@jit
def _decoded_scales(scales):
    """The scales as the eager decode applies them: NaN for a non-finite one."""
    out = np.empty(scales.size, dtype=np.float32)
    for r in range(scales.size):
        out[r] = decoded_scale(scales[r])
    return out


@jit(inline="always")
def _signed(byte, k, s):
    """Sign k of a packed ``byte`` (int32) times ``s``: -s for a set bit, s for a clear one."""
    return -s if (byte >> k) & 1 else s


# Signs are decoded a byte at a time by constant shifts: LLVM unrolls the loop over a byte's
# eight signs and vectorizes the loop over bytes (a lookup of each byte's eight values in a
# table it did not: 2x slower).


@jit(inline="always")
def _put_signs(row, s, accumulate, out):
    """out[i] = sign i of the packed ``row`` times ``s``, or with ``accumulate`` +=."""
    for j in range(out.size // 8):
        byte = np.int32(row[j])
        for k in range(8):
            if accumulate:
                out[8 * j + k] += _signed(byte, k, s)
            else:
                out[8 * j + k] = _signed(byte, k, s)
    for i in range(out.size - out.size % 8, out.size):
        if accumulate:
            out[i] += _signed(np.int32(row[i >> 3]), i & 7, s)
        else:
            out[i] = _signed(np.int32(row[i >> 3]), i & 7, s)


@jit
def _add_signs(row, s, acc):
    _put_signs(row, s, True, acc)


@jit
def scaled_signs(bits, scales, out):
    """Row r of ``out``: the first out.shape[1] signs of row r of ``bits`` times
    scales[r] (``packing.unpack_scaled_signs``)."""
    scales = _decoded_scales(scales)
    for r in range(scales.size):
        _put_signs(bits[r], scales[r], False, out[r])


@jit
def _averaged_at(bits, scales, count, residual, lr_ratio, i):
    value = np.float32(0.0)
    for r in range(scales.size):
        value += _signed(np.int32(bits[r, i >> 3]), i & 7, scales[r])
    value /= count
    return value + residual[i] * lr_ratio if residual.size else value


@jit(fastmath={"reassoc"})
def _averaged_l1(acc, count, out):
    total = 0.0
    for i in range(acc.size):
        out[i] = acc[i] / count
        total += abs(np.float64(out[i]))
    return total


@jit(fastmath={"reassoc"})
def _averaged_compensated_l1(acc, count, residual, lr_ratio, out):
    total = 0.0
    for i in range(acc.size):
        out[i] = acc[i] / count + residual[i] * lr_ratio
        total += abs(np.float64(out[i]))
    return total


@jit
def _averaged_bytes_l1(bits, scales, count, residual, lr_ratio, out):
    """``averaged_block_l1``'s pass over whole bytes of ``bits``: the rows' signs summed
    into a chunk that stays in the cache, a row at a time, then averaged, compensated and
    summed; returns the sum of |out|."""
    acc = np.empty(CHUNK, dtype=np.float32)
    total = 0.0
    for start in range(0, out.size, CHUNK):
        stop = min(out.size, start + CHUNK)
        chunk = acc[: stop - start]
        chunk[:] = 0.0
        for r in range(scales.size):
            _add_signs(bits[r, start // 8 :], scales[r], chunk)
        if residual.size:
            total += _averaged_compensated_l1(
                chunk, count, residual[start:stop], lr_ratio, out[start:stop]
            )
        else:
            total += _averaged_l1(chunk, count, out[start:stop])
    return total


@jit
def averaged_block_l1(bits, scales, count, residual, lr_ratio, block, out, sums):
    """The server's pass over what it serves (its shard, or the replicated server's whole
    tensor), when that lies in one block of each worker's message: out = (sum over rows r
    of sign_r scales[r]) / count + residual * lr_ratio, the rows summed in order as the eager
    sum over rows (float32), and sums[b] = sum of |out| over the server's block b
    (float64). An empty ``residual`` means none. One pass where the average, the
    compensation and the block sums were three."""
    scales = _decoded_scales(scales)
    count, lr_ratio = np.float32(count), np.float32(lr_ratio)
    for b in range(sums.size):
        start, stop = b * block, min(out.size, (b + 1) * block)
        # Whole bytes in chunks; elements of a byte shared with another block one by one.
        first = min(-(-start // 8) * 8, stop)
        last = max(stop // 8 * 8, first)
        total = _averaged_bytes_l1(
            bits[:, first // 8 : last // 8],
            scales,
            count,
            residual[first:last] if residual.size else residual,
            lr_ratio,
            out[first:last],
        )
        for i in range(start, first):
            out[i] = _averaged_at(bits, scales, count, residual, lr_ratio, i)
            total += abs(np.float64(out[i]))
        for i in range(last, stop):
            out[i] = _averaged_at(bits, scales, count, residual, lr_ratio, i)
            total += abs(np.float64(out[i]))
        sums[b] = total
