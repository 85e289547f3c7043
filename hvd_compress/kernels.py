"""Fused CPU kernels for the codecs' per-element passes (numba, on numpy arrays):
dist-EF-blockSGD's worker and server, TernGrad's and the QSGD family's scales, encoding and
decoding.

Eager tensor code makes one pass over memory per operation: the worker's compensation,
block scales, signs, decoded message, residual and packing were nine passes and ~60 bytes
of memory traffic per gradient element, and the sharded server's unpack, average,
compensation, scales and second compression ~100 bytes per element of its shard. With more
ranks than cores (4 on 2 in the benchmarks) that traffic, not the network, bounded the step.
Each kernel here is one or two passes that produce exactly what the eager ops produce
(same float32 operations in the same order; block sums and norms in float64, as the
reference; the quantizers' draws those of ``seeding.uniforms``, computed in place), so
both ports use them for CPU tensors (through ``hvd_compress.fused``) and keep their own ops,
which run anywhere, for others.

Signs follow ``codes.SignCodes``: bit k of byte j is element 8 j + k, set for -1, and
-1 is every element that is not >= 0 (NaN included), as ``BlockSign.encode``; the
quantizers' codes and sums ``codes.IntCodes``.

Needs numba (``pip install hvd_compress[cpu]``); ``hvd_compress.fused`` imports this module
only where numba is installed, and only when a kernel is first needed.
"""

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


def _jit(function=None, **options):
    # nogil: Horovod's background thread and the other ranks' collectives go on during a
    # kernel. cache: compiled once per machine, not in every worker process.
    if function is None:
        return lambda f: _jit(f, **options)
    return numba.njit(nogil=True, cache=True, **options)(function)


# Loops that compute more per element than a copy does (the quantizers' draws and levels,
# the scales' float64 sums) fall behind the memory when their array is not in the cache: the
# hardware prefetcher runs only a little ahead of the loads such a loop issues, and left to
# it each pass waits on memory about as long as it computes. They run a piece at a time and,
# before each, ask for the cache lines a fixed distance ahead of it: a piece's worth at a
# time, since the core keeps only so many misses in flight, and a loop that asked for a
# whole chunk's lines at once waited for them as long as for the data. Loops that move more
# bytes than they compute on (the compensation, the decoding) are bounded by the memory's
# bandwidth, which asking earlier does not raise: they do not.
_SUM_PIECE = 1024  # elements of a sum's piece, and how far ahead of it lines are asked for
_CODE_PIECE = 512  # elements of an encoding's piece (how far ahead: ``quantized``)
_LINE = 64  # bytes


@intrinsic
def _prefetch_line(typingctx, array, index):
    """LLVM's prefetch of the cache line that holds array[index], for reading, into every
    level of the cache; a hint that changes no result."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        word = ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch", [byte], ir.FunctionType(ir.VoidType(), [byte, word, word, word])
        )
        address = builder.bitcast(builder.gep(data, [args[1]]), byte)
        # Read (0), locality 3 (keep in every level), data (1).
        builder.call(prefetch, [address] + [ir.Constant(word, k) for k in (0, 3, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@_jit(inline="always")
def _prefetch_ahead(array, start, stop, distance):
    """Asks for the cache lines of array[start + distance : stop + distance]: called for
    each piece start .. stop - 1 that a loop is about to work on, it keeps the lines
    ``distance`` elements ahead of the loop in flight."""
    step = max(_LINE // array.itemsize, 1)
    for i in range(start + distance, min(stop + distance, array.size), step):
        _prefetch_line(array, i)


@_jit
def _momentum_at(grad, buffer, mu, nesterov):
    """dist-EF-blockSGDM's worker momentum of one element: (m, u) with m = grad + mu buffer
    and u = grad + mu m (Nesterov) or m, float32. The type of ``mu`` (the float32 momentum,
    ``hvd_compress.fused.momentum_factor``) sets the rounding. A float64: each is rounded
    once to float32 from float64, where the product of two float32 values is exact: what
    the eager ``torch.add(..., alpha=mu)``'s fused multiply-add gives, but where the float64
    sum falls within half a float64 unit of a float32 rounding boundary (~2^-29 of
    elements). A float32: the product and the sum are each rounded, as TensorFlow's
    multiply and add ops round them."""
    m = np.float32(grad + buffer * mu)
    return m, np.float32(grad + m * mu) if nesterov else m


@_jit
def momentum(grad, buffer, mu, nesterov, out):
    """The worker momentum in one pass: out = m, and grad becomes u (``_momentum_at``)."""
    for i in range(grad.size):
        out[i], grad[i] = _momentum_at(grad[i], buffer[i], mu, nesterov)


# The loops over elements below are each alone in a function of their own, over whole
# arrays (slices of a block) and with no condition on which arrays are given: only loops of
# that shape did LLVM turn into vector instructions, 2-4x faster than the same arithmetic
# in a loop over a range of a larger array (3.2 against 0.74 ns per element for the
# momentum and compensation). reassoc lets the float64 sums of |p| run in vector lanes
# (they stay within float64 rounding of the reference's); it reorders nothing else: each
# float32 result is one operation per element, rounded as the eager op rounds it.


@_jit(fastmath={"reassoc"})
def _l1(p):
    total = 0.0
    for i in range(p.size):
        total += abs(np.float64(p[i]))
    return total


@_jit(fastmath={"reassoc"})
def _compensated_l1(vector, residual, ratio, out):
    total = 0.0
    for i in range(vector.size):
        out[i] = vector[i] + residual[i] * ratio
        total += abs(np.float64(out[i]))
    return total


@_jit(fastmath={"reassoc"})
def _accelerated_l1(vector, buffer, mu, nesterov, new_buffer, out):
    total = 0.0
    for i in range(vector.size):
        new_buffer[i], out[i] = _momentum_at(vector[i], buffer[i], mu, nesterov)
        total += abs(np.float64(out[i]))
    return total


@_jit(fastmath={"reassoc"})
def _accelerated_compensated_l1(vector, buffer, mu, nesterov, new_buffer, residual, ratio, out):
    total = 0.0
    for i in range(vector.size):
        new_buffer[i], u = _momentum_at(vector[i], buffer[i], mu, nesterov)
        out[i] = u + residual[i] * ratio
        total += abs(np.float64(out[i]))
    return total


@_jit
def compensated_block_l1(
    vector, buffer, mu, nesterov, new_buffer, residual, ratio, block, out, sums
):
    """out = u + residual * ratio (float32), and sums[b] = sum of |out| over block b
    (float64). u is ``vector``, or with a momentum ``buffer`` the u of ``_momentum_at``,
    whose m goes to ``new_buffer``. Empty ``buffer`` and ``residual`` mean none; with
    neither, out is not written and the sums are of ``vector``."""
    ratio = np.float32(ratio)
    for b in range(sums.size):
        s = slice(b * block, min(vector.size, (b + 1) * block))
        if buffer.size and residual.size:
            sums[b] = _accelerated_compensated_l1(
                vector[s], buffer[s], mu, nesterov, new_buffer[s], residual[s], ratio, out[s]
            )
        elif buffer.size:
            sums[b] = _accelerated_l1(vector[s], buffer[s], mu, nesterov, new_buffer[s], out[s])
        elif residual.size:
            sums[b] = _compensated_l1(vector[s], residual[s], ratio, out[s])
        else:
            sums[b] = _l1(vector[s])


@_jit(inline="always")
def _decoded_scale(scale):
    """A scale as the eager decodes apply it: NaN for a non-finite one (+inf flags a
    non-finite gradient), so that every decoded element is NaN."""
    return scale if np.isfinite(scale) else np.float32(np.nan)


# A block's signs and residual go a piece at a time, in three passes over the piece while it
# is in the cache, each a loop alone in a function: a flag byte per element, the flags
# packed eight to a byte from whole words, then the residual. One loop that packed each
# byte from its eight elements and wrote their residuals LLVM did not vectorize: it took
# twice the time of a pass that reads and writes p.
_SIGN_PIECE = 16384  # elements


@_jit
def _negative_flags(p, flags):
    for i in range(p.size):
        flags[i] = not p[i] >= 0


@_jit
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


@_jit
def _pack_signs(p, packed, flags):
    """The signs of ``p`` packed into ``packed`` (``codes.SignCodes``), a piece at a time
    through ``flags`` (``_SIGN_PIECE`` bytes of scratch)."""
    for start in range(0, p.size, _SIGN_PIECE):
        stop = min(p.size, start + _SIGN_PIECE)
        _negative_flags(p[start:stop], flags)
        _packed_flags(flags, stop - start, packed[start // 8 :])


@_jit(inline="always")
def _residual(p, s, residual):
    for i in range(p.size):
        residual[i] = p[i] - (s if p[i] >= 0 else -s)


# Each loop over elements is compiled twice, into a new residual and over p itself: given
# the same array twice, LLVM's test for overlapping arrays sends the loop down its scalar
# path (3x slower), where the array passed once is a loop it vectorizes.


@_jit
def _block_residual(p, s, residual):
    _residual(p, s, residual)


@_jit
def _block_residual_in_place(p, s):
    _residual(p, s, p)


@_jit
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


@_jit
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
        s = _decoded_scale(scale[b])
        start, stop = b * block, min(p.size, (b + 1) * block)
        if aligned:
            kept = residual if in_place else residual[start:stop]
            _block_signs(p[start:stop], s, packed[start // 8 :], kept, flags)
        elif in_place:
            _block_residual_in_place(p[start:stop], s)
        else:
            _block_residual(p[start:stop], s, residual[start:stop])


# Sums of several rows' codes are decoded a chunk of elements at a time: a chunk's codes or
# sums wait in a buffer small enough to stay in the cache, and each loop over it is alone in
# a function, as above. Chunks start on byte boundaries.
_CHUNK = 4096


@_jit
def _decoded_scales(scales):
    """The scales as the eager decode applies them: NaN for a non-finite one."""
    out = np.empty(scales.size, dtype=np.float32)
    for r in range(scales.size):
        out[r] = _decoded_scale(scales[r])
    return out


@_jit(inline="always")
def _signed(byte, k, s):
    """Sign k of a packed ``byte`` (int32) times ``s``: -s for a set bit, s for a clear one."""
    return -s if (byte >> k) & 1 else s


# Signs are decoded a byte at a time by constant shifts: LLVM unrolls the loop over a byte's
# eight signs and vectorizes the loop over bytes (a lookup of each byte's eight values in a
# table it did not: 2x slower).


@_jit(inline="always")
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


@_jit
def _add_signs(row, s, acc):
    _put_signs(row, s, True, acc)


@_jit
def scaled_signs(bits, scales, out):
    """Row r of ``out``: the first out.shape[1] signs of row r of ``bits`` times
    scales[r] (``packing.unpack_scaled_signs``)."""
    scales = _decoded_scales(scales)
    for r in range(scales.size):
        _put_signs(bits[r], scales[r], False, out[r])


@_jit
def _averaged_at(bits, scales, count, residual, ratio, i):
    value = np.float32(0.0)
    for r in range(scales.size):
        value += _signed(np.int32(bits[r, i >> 3]), i & 7, scales[r])
    value /= count
    return value + residual[i] * ratio if residual.size else value


@_jit(fastmath={"reassoc"})
def _averaged_l1(acc, count, out):
    total = 0.0
    for i in range(acc.size):
        out[i] = acc[i] / count
        total += abs(np.float64(out[i]))
    return total


@_jit(fastmath={"reassoc"})
def _averaged_compensated_l1(acc, count, residual, ratio, out):
    total = 0.0
    for i in range(acc.size):
        out[i] = acc[i] / count + residual[i] * ratio
        total += abs(np.float64(out[i]))
    return total


@_jit
def _averaged_bytes_l1(bits, scales, count, residual, ratio, out):
    """``averaged_block_l1``'s pass over whole bytes of ``bits``: the rows' signs summed
    into a chunk that stays in the cache, a row at a time, then averaged, compensated and
    summed; returns the sum of |out|."""
    acc = np.empty(_CHUNK, dtype=np.float32)
    total = 0.0
    for start in range(0, out.size, _CHUNK):
        stop = min(out.size, start + _CHUNK)
        chunk = acc[: stop - start]
        chunk[:] = 0.0
        for r in range(scales.size):
            _add_signs(bits[r, start // 8 :], scales[r], chunk)
        if residual.size:
            total += _averaged_compensated_l1(
                chunk, count, residual[start:stop], ratio, out[start:stop]
            )
        else:
            total += _averaged_l1(chunk, count, out[start:stop])
    return total


@_jit
def averaged_block_l1(bits, scales, count, residual, ratio, block, out, sums):
    """The server's pass over what it serves (its shard, or the replicated server's whole
    tensor), when that lies in one block of each worker's message: out = (sum over rows r
    of sign_r scales[r]) / count + residual * ratio, the rows summed in order as the eager
    sum over rows (float32), and sums[b] = sum of |out| over the server's block b
    (float64). An empty ``residual`` means none. One pass where the average, the
    compensation and the block sums were three."""
    scales = _decoded_scales(scales)
    count, ratio = np.float32(count), np.float32(ratio)
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
            ratio,
            out[first:last],
        )
        for i in range(start, first):
            out[i] = _averaged_at(bits, scales, count, residual, ratio, i)
            total += abs(np.float64(out[i]))
        for i in range(last, stop):
            out[i] = _averaged_at(bits, scales, count, residual, ratio, i)
            total += abs(np.float64(out[i]))
        sums[b] = total


# ----- TernGrad and the QSGD family: scales, draws, levels, fixed-width codes -----
#
# Their codes are packed (``codes.IntCodes``) and sums decoded a chunk (``_CHUNK``) of
# elements at a time, as the server's signs are.

# error_model="numpy" on the kernels that divide: a division by zero gives inf or NaN as in
# numpy and torch, instead of a check for ZeroDivisionError in every iteration, which kept
# LLVM from vectorizing a loop whose divisor varies.


# max|g| is found as the max of the bits of |g| (those of g, ``bits``, read as int32, without
# the sign bit), which order as |g| does, NaN above inf: exact, and a reduction of integers
# that LLVM vectorizes, where the maximum of floats it does not.


# reassoc and contract: the sums' order and rounding are free (float64 sums of float32
# elements, as exact in any order as the float32 results need), and the vectorized loop
# with fused multiply-adds is a memory pass, not the adds' latency chain.
@_jit(fastmath={"reassoc", "contract"})
def _shifted_moments_and_top(g, bits, shift):
    total, squares, top = 0.0, 0.0, np.int32(0)
    for i in range(g.size):
        d = np.float64(g[i]) - shift
        total += d
        squares += d * d
        top = max(top, bits[i] & np.int32(0x7FFFFFFF))
    return total, squares, top


@_jit
def shifted_moments_and_top(g, bits):
    """TernGrad's one pass (``terngrad.shifted_variance``): the float64 sums of d and d^2
    for d = g - g[0], and the bits of max|g|."""
    shift = np.float64(g[0]) if g.size else 0.0
    total, squares, top = 0.0, 0.0, np.int32(0)
    for start in range(0, g.size, _SUM_PIECE):
        stop = min(g.size, start + _SUM_PIECE)
        _prefetch_ahead(g, start, stop, _SUM_PIECE)
        piece = _shifted_moments_and_top(g[start:stop], bits[start:stop], shift)
        total, squares, top = total + piece[0], squares + piece[1], max(top, piece[2])
    return total, squares, top


@_jit(fastmath={"reassoc"})
def _squares(g):
    total = 0.0
    for i in range(g.size):
        total += np.float64(g[i]) * np.float64(g[i])
    return total


@_jit
def _top(bits):
    top = np.int32(0)
    for i in range(bits.size):
        top = max(top, bits[i] & np.int32(0x7FFFFFFF))
    return top


@_jit(inline="always")
def _bucket_squares(g, b, bucket):
    """The float64 sum of g^2 over bucket b, a piece at a time."""
    total = 0.0
    bucket_stop = min(g.size, (b + 1) * bucket)
    for start in range(b * bucket, bucket_stop, _SUM_PIECE):
        stop = min(bucket_stop, start + _SUM_PIECE)
        _prefetch_ahead(g, start, stop, _SUM_PIECE)
        total += _squares(g[start:stop])
    return total


@_jit(inline="always")
def _bucket_top(bits, b, bucket):
    """The bits of max|g| over bucket b (``bits``: g's float32 bits), a piece at a time."""
    top = np.int32(0)
    bucket_stop = min(bits.size, (b + 1) * bucket)
    for start in range(b * bucket, bucket_stop, _SUM_PIECE):
        stop = min(bucket_stop, start + _SUM_PIECE)
        _prefetch_ahead(bits, start, stop, _SUM_PIECE)
        top = max(top, _top(bits[start:stop]))
    return top


@_jit
def bucket_squares(g, bucket, sums):
    """QSGD's and NUQSGD's L2 norms, squared: sums[b] = float64 sum of g^2 over bucket b."""
    for b in range(sums.size):
        sums[b] = _bucket_squares(g, b, bucket)


@_jit
def bucket_tops(bits, bucket, tops):
    """QSGD-inf's max norms: tops[b] = the bits of max|g| over bucket b."""
    for b in range(tops.size):
        tops[b] = _bucket_top(bits, b, bucket)


# The norms a ``quantized`` call computes itself, for scales that no collective shares.
GIVEN_SCALES, MAX_NORMS, L2_NORMS = 0, 1, 2


@_jit(inline="always")
def _bucket_norm(p, bits, b, bucket, norm):
    """Bucket b's scale by ``norm``, as ``fused.local_scale`` gives it before its test of
    finiteness: max|p| (``bucket_tops``), or the L2 norm rounded from float64."""
    if norm == L2_NORMS:
        return np.float32(np.sqrt(_bucket_squares(p, b, bucket)))
    return np.int32(_bucket_top(bits, b, bucket)).view(np.float32)


# numba computes with uint32 words in int64: every result is cut back to 32 bits, which
# LLVM turns into 32-bit vector operations.


@_jit(inline="always")
def _lowbias32(x):
    x = np.uint32(x ^ (x >> 16))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> 15))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> 16))


@_jit(inline="always")
def _word(first, stream):
    """The word that draw ``first`` of ``stream`` = (lo, multiplier) (``seeding.key_words``)
    hashes: first multiplier + lo, modulo 2^32. Draw k + 1's is draw k's plus the
    multiplier: the loops step it so, with no product per draw."""
    lo, multiplier = stream
    return np.uint32(np.uint32(np.uint32(first) * multiplier) + lo)


@_jit(inline="always")
def _uniform(word):
    """The draw of a ``_word``: ``seeding.uniforms``."""
    return np.float32(np.uint32(_lowbias32(word) >> 8)) * np.float32(2.0**-24)


@_jit(inline="always")
def _divisor(scale):
    """The divisor S of a bucket's ratios |g| / S: its scale, or inf for a zero or
    non-finite scale (every ratio 0, as ``normalized``)."""
    return scale if np.isfinite(scale) and scale > 0 else np.float32(np.inf)


@_jit(inline="always")
def _ratio(g, divisor):
    """|g| / S of the eager ``buckets.ratio`` (``divisor``: S, or inf for a zero or
    non-finite S), with 0 for NaN as ``normalized``."""
    a = abs(g) / divisor
    return a if a == a else np.float32(0.0)


@_jit(inline="always")
def _uniform_code(g, divisor, levels, u):
    """``UniformQuantizer.encode`` of one element under s = ``levels`` (float32)."""
    x = _ratio(g, divisor) * levels
    low = min(np.floor(x), levels - np.float32(1.0))
    level = np.int32(low + np.float32(u < x - low))
    return -level if g < 0 else level


@_jit(inline="always")
def _one_level_code(g, divisor, u):
    """``_uniform_code`` under s = 1 (TernGrad, 2-bit QSGD): x is the ratio itself and
    min(floor(x), 0) is 0, so the level is the draw's test alone."""
    level = np.int32(u < _ratio(g, divisor))
    return -level if g < 0 else level


@_jit(inline="always")
def _nuqsgd_code(g, divisor, s, u):
    """``NUQSGD.encode`` of one element with smallest level 2^-s: the index of the level
    below r (the frexp of the eager op), then drawn up to the level above it."""
    r = min(_ratio(g, divisor), np.float32(1.0))
    # The level below r >= 2^-s is 2^e, e the binary exponent of r, its index e + s + 1
    # (r = 1 is level s + 1 itself); below 2^-s it is 0, index 0. The gap to the next
    # level is 2^e (2^-s above 0), so r's place in it, (r - 2^e) / 2^e, is the fraction
    # of r's significand, read from its bits exactly; below 2^-s it is r 2^s, also exact.
    bits = np.float32(r).view(np.int32)
    biased = bits >> 23  # e + 127
    above = biased >= 127 - s
    index = biased - 126 + s if above else 0
    fraction = np.int32((bits & 0x7FFFFF) | 0x3F800000).view(np.float32) - np.float32(1.0)
    index += u < (fraction if above else r * _power(s))
    return -index if g < 0 else index


@_jit(inline="always")
def _power(s):
    """2^s, float32."""
    return np.int32((127 + s) << 23).view(np.float32)


@_jit(inline="always")
def _nuqsgd_value(code):
    """``NUQSGD.values``: sign(code) 2^(|code| - 1), 0 for 0."""
    index = abs(code)
    value = (np.int32(1) << index) >> 1  # 0 for 0
    return -value if code < 0 else value


# The code loops write code + ``offset`` into ``out``: the packed exchanges' fields
# (``codes.IntCodes``: code + bound, one per byte of a uint8 ``out``, which costs a quarter
# of int32 codes' stores), or the codes themselves (int32, offset 0) for the allreduce's
# values. Element first + i hashes the 32-bit word of ``_word``, stepped beside i rather
# than computed from the 64-bit first + i: LLVM then keeps it in 32-bit vector lanes.


@_jit(inline="always")
def _uniform_codes(p, divisor, levels, one_level, first, stream, offset, out):
    x = _word(first, stream)
    for i in range(p.size):
        u = _uniform(x)
        if one_level:
            out[i] = _one_level_code(p[i], divisor, u) + offset
        else:
            out[i] = _uniform_code(p[i], divisor, levels, u) + offset
        x = np.uint32(x + stream[1])


@_jit(inline="always")
def _uniform_codes_with_feedback(
    p, divisor, levels, one_level, first, stream, scale, offset, out, residual
):
    x = _word(first, stream)
    for i in range(p.size):
        u = _uniform(x)
        if one_level:
            code = _one_level_code(p[i], divisor, u)
        else:
            code = _uniform_code(p[i], divisor, levels, u)
        out[i] = code + offset
        residual[i] = p[i] - np.float32(code) * scale / levels
        x = np.uint32(x + stream[1])


@_jit(inline="always")
def _code_piece(position, stop, bucket):
    """(b, end): the bucket b of element ``position`` and the end of the encoding's piece
    that starts there, at the bucket's end, the next multiple of ``_CODE_PIECE`` or
    ``stop``, whichever comes first."""
    b = position // bucket
    return b, min(stop, (b + 1) * bucket, (position // _CODE_PIECE + 1) * _CODE_PIECE)


@_jit(inline="always", error_model="numpy")
def _uniform_buckets(p, start, stop, quantizer, one_level, feedback, offset, out, residual):
    """``_uniform_codes`` (with ``feedback``, ``_uniform_codes_with_feedback``) of elements
    start .. stop - 1 of ``p`` into ``out`` (from its element 0), bucket by bucket and
    ``_CODE_PIECE`` by ``_CODE_PIECE``, asking for the lines ``ahead`` elements on."""
    scale, bucket, levels, _, stream, ahead = quantizer
    s = np.float32(levels)
    position = start
    while position < stop:
        b, end = _code_piece(position, stop, bucket)
        _prefetch_ahead(p, position, end, ahead)
        divisor = _divisor(scale[b])
        piece, into = p[position:end], out[position - start : end - start]
        if feedback:
            decoded = _decoded_scale(scale[b])
            # Sliced here, where feedback is a constant: with the array chosen by a
            # condition inside this inlined loop, the element loop ran 4x slower.
            kept = residual[position:end]
            _uniform_codes_with_feedback(
                piece, divisor, s, one_level, position, stream, decoded, offset, into, kept
            )
        else:
            _uniform_codes(piece, divisor, s, one_level, position, stream, offset, into)
        position = end


@_jit(inline="always")
def _nuqsgd_codes(p, divisor, s, first, stream, scale, offset, out, residual):
    # s is a constant where this is inlined, so LLVM unrolls the loop over levels and
    # vectorizes the loop over elements.
    x = _word(first, stream)
    for i in range(p.size):
        out[i] = _nuqsgd_code(p[i], divisor, s, _uniform(x)) + offset
        x = np.uint32(x + stream[1])
    # The residual from the codes, in a loop of its own over the chunk (in the loop above it
    # keeps LLVM from vectorizing); / 2^s as a product, which is exactly the same and cheaper.
    for i in range(residual.size):
        code = np.int32(out[i]) - offset
        residual[i] = p[i] - np.float32(_nuqsgd_value(code)) * scale * np.float32(2.0**-s)


@_jit(inline="always", error_model="numpy")
def _nuqsgd_buckets(p, start, stop, quantizer, s, offset, out, residual):
    """``_nuqsgd_codes`` with smallest level 2^-``s`` of elements start .. stop - 1 of ``p``
    into ``out`` (from its element 0), as ``_uniform_buckets`` goes."""
    scale, bucket, _, _, stream, ahead = quantizer
    position = start
    while position < stop:
        b, end = _code_piece(position, stop, bucket)
        _prefetch_ahead(p, position, end, ahead)
        piece, into = p[position:end], out[position - start : end - start]
        kept = residual[position:end] if residual.size else residual
        decoded = _decoded_scale(scale[b])
        _nuqsgd_codes(piece, _divisor(scale[b]), s, position, stream, decoded, offset, into, kept)
        position = end


@_jit(error_model="numpy")
def _quantize(p, start, quantizer, offset, out, residual):
    """code + ``offset`` of elements start .. start + out.size - 1 of ``p`` into ``out``
    under ``quantizer`` = (scale, bucket, levels, exponent, stream, ahead) of ``quantized``, each
    under its bucket's scale; their residuals into ``residual``'s elements if it is not
    empty."""
    # One inlined copy of the bucket loop per kind of element loop, its kind a constant
    # there, so that LLVM specializes each (s = 1 drops the general code's floor, min and
    # conversions; NUQSGD's loop over levels unrolls) and no call is made per bucket.
    _, _, levels, exponent, _, _ = quantizer
    stop, feedback = start + out.size, residual.size > 0
    if levels == 1 and feedback:
        _uniform_buckets(p, start, stop, quantizer, True, True, offset, out, residual)
    elif levels == 1:
        _uniform_buckets(p, start, stop, quantizer, True, False, offset, out, residual)
    elif levels and feedback:
        _uniform_buckets(p, start, stop, quantizer, False, True, offset, out, residual)
    elif levels:
        _uniform_buckets(p, start, stop, quantizer, False, False, offset, out, residual)
    elif exponent == 0:
        _nuqsgd_buckets(p, start, stop, quantizer, 0, offset, out, residual)
    elif exponent == 2:
        _nuqsgd_buckets(p, start, stop, quantizer, 2, offset, out, residual)
    elif exponent == 6:
        _nuqsgd_buckets(p, start, stop, quantizer, 6, offset, out, residual)
    else:
        _nuqsgd_buckets(p, start, stop, quantizer, 14, offset, out, residual)


# Packing reads the fields four (2 bits) or two (4 bits) at a time as one little-endian word
# (every platform numba targets is little-endian) and moves each to its place with a
# constant shift: a loop over contiguous words, which LLVM vectorizes, where a loop
# gathering every fourth byte it vectorizes poorly.


@_jit
def _pack_fields(fields, width, packed):
    """``fields`` (one per byte, each less than 2^``width``; a multiple of 8 / ``width``
    of them) packed ``width`` bits each, little-endian in each byte, into ``packed``
    (``codes.IntCodes``)."""
    if width == 2:
        words = fields.view(np.uint32)
        for j in range(words.size):
            w = words[j]
            packed[j] = (
                (w & np.uint32(0x3))
                | ((w >> np.uint32(6)) & np.uint32(0xC))
                | ((w >> np.uint32(12)) & np.uint32(0x30))
                | ((w >> np.uint32(18)) & np.uint32(0xC0))
            )
    elif width == 4:
        halves = fields.view(np.uint16)
        for j in range(halves.size):
            w = halves[j]
            packed[j] = (w & np.uint16(0xF)) | ((w >> np.uint16(4)) & np.uint16(0xF0))
    else:
        for j in range(fields.size):
            packed[j] = fields[j]


@_jit
def _pack_chunk(fields, count, bound, width, packed):
    """The first ``count`` of the chunk ``fields`` packed into ``packed``, the last byte's
    free fields the code 0 (``bound``), as ``codes.IntCodes`` pads."""
    per = 8 // width
    whole = -(-count // per) * per
    fields[count:whole] = bound
    _pack_fields(fields[:whole], width, packed)


@_jit(error_model="numpy")
def quantized(
    p, bits, norm, scale, bucket, levels, exponent, stream, bound, width, values, packed, residual
):
    """One worker's codes of ``p`` under its bucket scales, drawn from ``stream``
    (``seeding.key_words``; draw k for element k of ``seeding.uniforms``):
    ``UniformQuantizer`` with s = ``levels``, or with ``levels`` 0 ``NUQSGD`` with
    2^-``exponent`` its smallest level. Written as the exchange sends them: into ``packed``
    at ``width`` bits per code (``codes.IntCodes(bound)``), or else into ``values`` (the
    codes' values, in the allreduce's carrier). With a ``residual``, p - decode(values,
    scale, 1) goes there (NaN where the scale is not finite, as the eager decode gives).

    ``norm``: ``GIVEN_SCALES``, or the scales' norm (``MAX_NORMS``, read from ``bits``, p's
    float32 bits; ``L2_NORMS``), each bucket's written into ``scale`` a chunk ahead of its
    codes, while its elements are in the cache: one pass over p where a pass for the
    scales and one for the codes read it twice. Returns whether every scale it computed is
    finite (True for ``GIVEN_SCALES``); where one is not, the caller encodes again under
    the scales ``local_scale`` gives a non-finite gradient."""
    # Each piece asks for the lines of what the next chunk reads first: its own elements,
    # or, where this pass takes the norms, the next bucket's, when it is a few chunks long
    # (the norms' sums ask for the lines of longer buckets themselves).
    ahead = bucket if norm != GIVEN_SCALES and _CHUNK < bucket <= 4 * _CHUNK else _CHUNK
    quantizer = (scale, bucket, levels, exponent, stream, ahead)
    fields = np.empty(_CHUNK if packed.size else 0, dtype=np.uint8)
    codes = np.empty(0 if packed.size else _CHUNK, dtype=np.int32)
    finite, scaled = True, 0  # buckets whose scales ``norm`` has written
    for start in range(0, p.size, _CHUNK):
        count = min(p.size - start, _CHUNK)
        if norm != GIVEN_SCALES:
            needed = -(-(start + count) // bucket)
            for b in range(scaled, needed):
                scale[b] = _bucket_norm(p, bits, b, bucket, norm)
                finite &= np.isfinite(scale[b])
            scaled = needed
        if packed.size and width == 8:  # a field per byte: the codes go to ``packed`` directly
            _quantize(p, start, quantizer, np.int32(bound), packed[start : start + count], residual)
        elif packed.size:
            _quantize(p, start, quantizer, np.int32(bound), fields[:count], residual)
            _pack_chunk(fields, count, bound, width, packed[start * width // 8 :])
        else:
            _quantize(p, start, quantizer, np.int32(0), codes[:count], residual)
            _values(codes[:count], levels, values[start : start + count])
    return finite


@_jit
def _values(codes, levels, out):
    """The codes' values (``Codec.values``) in the allreduce carrier ``out``."""
    if levels:
        for i in range(codes.size):
            out[i] = codes[i]
    else:
        for i in range(codes.size):
            out[i] = _nuqsgd_value(codes[i])


@_jit
def _pack_any(codes, bound, width, fields, packed):
    """``codes`` packed for every width of ``codes.IntCodes``: through the chunk buffer
    ``fields`` for 2, 4 and 8 bits, 16 and 32 bits little-endian."""
    if width <= 8:
        for i in range(codes.size):
            fields[i] = codes[i] + bound
        _pack_chunk(fields, codes.size, bound, width, packed)
        return
    nbytes = width // 8
    for i in range(codes.size):
        field = codes[i] + bound
        for t in range(nbytes):
            packed[nbytes * i + t] = (field >> (8 * t)) & 0xFF


@_jit(inline="always")
def _field_value(field, bound, nuqsgd):
    """The value of a packed field: its code, field - bound, or with ``nuqsgd`` that code's
    ``NUQSGD.values``."""
    code = np.int32(field) - bound
    return _nuqsgd_value(code) if nuqsgd else code


# The receiving side unpacks a chunk of a row into a field per byte first, four (2 bits) or
# two (4 bits) from each byte by constant shifts into one word, as ``_pack_fields`` packs
# them; the loops that add or decode the values then run over contiguous fields. Both
# vectorize, where one loop over the row's bytes storing each byte's fields four elements
# apart vectorizes poorly (it took 1.5x the time of the two for 2-bit codes).


@_jit
def _unpack_fields(row, width, count, fields):
    """The first ``count`` fields of the packed ``row`` (``codes.IntCodes`` of 2, 4 or 8
    bits, field 0 at a byte's start), one per byte, into ``fields`` (``_CHUNK`` bytes)."""
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


@_jit(inline="always")
def _add_values(fields, bound, nuqsgd, acc):
    for i in range(acc.size):
        acc[i] += _field_value(fields[i], bound, nuqsgd)


@_jit
def _add_fields(row, width, bound, nuqsgd, fields, acc):
    """acc[i] += the value of field i of the packed ``row`` (``_field_value``): codes of 2,
    4 or 8 bits, unpacked through the scratch ``fields``."""
    _unpack_fields(row, width, acc.size, fields)
    # One inlined copy per kind of value.
    if nuqsgd:
        _add_values(fields, np.int32(bound), True, acc)
    else:
        _add_values(fields, np.int32(bound), False, acc)


@_jit(error_model="numpy")
def _decoded(total, divisor, scale, out):
    for i in range(total.size):
        out[i] = np.float32(total[i]) * scale / divisor


@_jit
def _decode(total, first, scale, bucket, divisor, out):
    """out (elements first .. first + total.size) = ``Codec.decode`` of ``total``: total
    scale[b] / divisor in float32, NaN where scale[b] is not finite."""
    position, stop = first, first + total.size
    while position < stop:
        b = position // bucket
        end = min(stop, (b + 1) * bucket)
        scale_b = _decoded_scale(scale[b])
        piece = slice(position - first, end - first)
        _decoded(total[piece], divisor, scale_b, out[piece])
        position = end


@_jit
def decoded_totals(total, scale, bucket, divisor, out):
    """The allreduce's decode: out = ``Codec.decode`` of the summed values ``total``."""
    _decode(total, 0, scale, bucket, np.float32(divisor), out)


@_jit
def summed_codes(rows, width, bound, nuqsgd, length, total_bound, total_width, out):
    """The sharded exchange's sum: the values (``_field_value``) of the first ``length``
    codes of each row of ``rows`` (``width``-bit ``IntCodes(bound)``) summed over the rows
    in int32 and packed into ``out`` at ``total_width`` bits (``IntCodes(total_bound)``)."""
    sums = np.empty(_CHUNK, dtype=np.int32)
    fields = np.empty(_CHUNK, dtype=np.uint8)
    for start in range(0, length, _CHUNK):
        chunk = sums[: min(length, start + _CHUNK) - start]
        chunk[:] = 0
        for r in range(rows.shape[0]):
            _add_fields(rows[r, start * width // 8 :], width, bound, nuqsgd, fields, chunk)
        _pack_any(chunk, total_bound, total_width, fields, out[start * total_width // 8 :])


@_jit(inline="always", error_model="numpy")
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


@_jit(inline="always", error_model="numpy")
def _scaled_fields(fields, bound, nuqsgd, partial, scale, divisor, add, out):
    """out = or += the decode under ``scale`` / ``divisor`` of the values of ``fields`` (plus
    ``partial``'s, if it is not empty)."""
    # One inlined copy per kind of value.
    if nuqsgd:
        _scaled_values(fields, bound, True, partial, scale, divisor, add, out)
    else:
        _scaled_values(fields, bound, False, partial, scale, divisor, add, out)


@_jit(error_model="numpy")
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


@_jit(error_model="numpy")
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
            scale_b = _decoded_scale(scale[b])
            _decoded_wide(row[lo * width // 8 :], width, bound, scale_b, divisor, out[lo:hi])
            position = end
        return
    for start in range(0, out.size, _CHUNK):
        count = min(out.size - start, _CHUNK)
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
                _decoded_scale(scale[b]),
                divisor,
                add,
                out[lo:hi],
            )
            position = end


@_jit
def decoded_sums(rows, width, bound, nuqsgd, scale, bucket, divisor, out):
    """The allgather's decode under a shared scale: out = decode of the sum over rows of
    the values of their first out.size codes."""
    sums = np.empty(_CHUNK, dtype=np.int32)
    fields = np.empty(_CHUNK, dtype=np.uint8)
    divisor = np.float32(divisor)
    last = rows.shape[0] - 1
    for start in range(0, out.size, _CHUNK):
        stop = min(out.size, start + _CHUNK)
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


@_jit
def decoded_own_scales(rows, width, bound, nuqsgd, scales, bucket, divisor, out):
    """The allgather's decode under each worker's own scales (row r of ``scales``): out =
    the sum over rows, in order, of the decoded values of their first out.size codes."""
    none = np.empty(0, dtype=np.int32)
    fields = np.empty(_CHUNK, dtype=np.uint8)
    divisor = np.float32(divisor)
    # A chunk at a time, so that each row adds to a piece of ``out`` still in the cache.
    for start in range(0, out.size, _CHUNK):
        stop = min(out.size, start + _CHUNK)
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


@_jit
def decoded_segments(rows, width, bound, length, scale, bucket, divisor, out):
    """The sharded exchange's decode: row r holds the summed values of elements
    r length .. (r + 1) length - 1, decoded into ``out`` (cut at out.size)."""
    none = np.empty(0, dtype=np.int32)
    fields = np.empty(_CHUNK, dtype=np.uint8)
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


@_jit
def draws(stream, out):
    """Draws 0 .. out.size - 1 of ``stream`` (``seeding.key_words``), as the kernels above
    draw them inside their loops: for tests to compare with ``seeding.uniforms``."""
    x = _word(0, stream)
    for k in range(out.size):
        out[k] = _uniform(x)
        x = np.uint32(x + stream[1])
