"""Fused CPU kernels for dist-EF-blockSGD's per-element passes (numba, on numpy arrays).

Eager tensor code makes one pass over memory per operation: the worker's compensation,
block scales, signs, decoded message, residual and packing were nine passes and ~60 bytes
of memory traffic per gradient element, and the sharded server's unpack, average,
compensation, scales and second compression ~100 bytes per element of its shard. With more
ranks than cores (4 on 2 in the benchmarks) that traffic, not the network, bounded the step.
Each kernel here is one or two passes that produce exactly what the eager ops produce
(same float32 operations in the same order; block sums in float64, as the reference), so
the PyTorch port uses them for CPU tensors and keeps the eager ops, which run anywhere, for
others. The TensorFlow port runs its steps inside ``tf.function`` graphs, where these do not.

Signs follow ``codes.SignCodes``: bit k of byte j is element 8 j + k, set for -1, and
-1 is every element that is not >= 0 (NaN included), as ``BlockSign.encode``.

Needs numba (``pip install hvd_compress[cpu]``); ``hvd_compress.pt.fused`` imports this module
only where numba is installed, and only when a kernel is first needed.
"""
import numba
import numpy as np


def _jit(function=None, **options):
    # nogil: Horovod's background thread and the other ranks' collectives go on during a
    # kernel. cache: compiled once per machine, not in every worker process.
    if function is None:
        return lambda f: _jit(f, **options)
    return numba.njit(nogil=True, cache=True, **options)(function)


@_jit
def _momentum_at(grad, buffer, mu, nesterov):
    """dist-EF-blockSGDM's worker momentum of one element: (m, u) with m = grad + mu buffer
    and u = grad + mu m (Nesterov) or m; ``mu`` is the float32 momentum as a float64. Each
    is rounded once to float32 from float64, where the product of two float32 values is
    exact: what the eager ``torch.add(..., alpha=mu)``'s fused multiply-add gives, but
    where the float64 sum falls within half a float64 unit of a float32 rounding boundary
    (~2^-29 of elements)."""
    m = np.float32(np.float64(grad) + np.float64(buffer) * mu)
    return m, np.float32(np.float64(grad) + np.float64(m) * mu) if nesterov else m


@_jit
def momentum(grad, buffer, mu, nesterov, out):
    """The worker momentum in one pass: out = m, and grad becomes u (``_momentum_at``)."""
    mu = np.float64(np.float32(mu))
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
def _accelerated_compensated_l1(vector, buffer, mu, nesterov, new_buffer, residual, ratio,
                                out):
    total = 0.0
    for i in range(vector.size):
        new_buffer[i], u = _momentum_at(vector[i], buffer[i], mu, nesterov)
        out[i] = u + residual[i] * ratio
        total += abs(np.float64(out[i]))
    return total


@_jit
def compensated_block_l1(vector, buffer, mu, nesterov, new_buffer, residual, ratio, block,
                         out, sums):
    """out = u + residual * ratio (float32), and sums[b] = sum of |out| over block b
    (float64). u is ``vector``, or with a momentum ``buffer`` the u of ``_momentum_at``,
    whose m goes to ``new_buffer``. Empty ``buffer`` and ``residual`` mean none; with
    neither, out is not written and the sums are of ``vector``."""
    ratio, mu = np.float32(ratio), np.float64(np.float32(mu))
    for b in range(sums.size):
        s = slice(b * block, min(vector.size, (b + 1) * block))
        if buffer.size and residual.size:
            sums[b] = _accelerated_compensated_l1(vector[s], buffer[s], mu, nesterov,
                                                  new_buffer[s], residual[s], ratio, out[s])
        elif buffer.size:
            sums[b] = _accelerated_l1(vector[s], buffer[s], mu, nesterov, new_buffer[s],
                                      out[s])
        elif residual.size:
            sums[b] = _compensated_l1(vector[s], residual[s], ratio, out[s])
        else:
            sums[b] = _l1(vector[s])


@_jit
def _signs_with_feedback_bytes(p, s, packed, residual):
    """``signs_with_feedback`` of one block that starts on a byte boundary, reading p once."""
    for j in range(p.size // 8):
        byte = 0
        for k in range(8):
            negative = not p[8 * j + k] >= 0
            residual[8 * j + k] = p[8 * j + k] - (-s if negative else s)
            byte |= negative << k
        packed[j] = byte
    if p.size % 8:
        byte = 0
        for i in range(p.size - p.size % 8, p.size):
            negative = not p[i] >= 0
            residual[i] = p[i] - (-s if negative else s)
            byte |= negative << (i % 8)
        packed[p.size // 8] = byte


@_jit
def _residual(p, s, residual):
    for i in range(p.size):
        residual[i] = p[i] - (s if p[i] >= 0 else -s)


@_jit
def signs_with_feedback(p, scale, block, packed, residual):
    """One BlockSign message with error feedback: the packed signs of ``p`` and the
    residual p - sign(p) scale[b] of each block b (NaN where the scale is not finite, as
    the eager decode gives). ``packed`` holds at least ceil(p.size / 8) bytes; the bits
    of a last partial byte past p.size are 0 (+1, cut off by every receiver)."""
    # Every block starts on a byte boundary, or some share a byte.
    aligned = block % 8 == 0 or scale.size == 1
    for b in range(scale.size):
        s = scale[b] if np.isfinite(scale[b]) else np.float32(np.nan)
        start, stop = b * block, min(p.size, (b + 1) * block)
        if aligned:
            _signs_with_feedback_bytes(p[start:stop], s, packed[start // 8:],
                                       residual[start:stop])
        else:
            _residual(p[start:stop], s, residual[start:stop])
    if not aligned:
        _pack_signs(p, packed)


@_jit
def _pack_signs(p, packed):
    """Blocks that share a byte: the signs of ``p`` packed in a pass of their own."""
    for j in range(p.size // 8):
        byte = 0
        for k in range(8):
            byte |= (not p[8 * j + k] >= 0) << k
        packed[j] = byte
    if p.size % 8:
        byte = 0
        for i in range(p.size - p.size % 8, p.size):
            byte |= (not p[i] >= 0) << (i % 8)
        packed[p.size // 8] = byte


@_jit
def _sign_tables(scales):
    """Row (r, byte): the eight signs of ``byte`` times scales[r] (NaN for a non-finite
    scale), so that one packed byte becomes eight floats by one lookup."""
    tables = np.empty((scales.size, 256, 8), dtype=np.float32)
    for r in range(scales.size):
        s = scales[r] if np.isfinite(scales[r]) else np.float32(np.nan)
        for byte in range(256):
            for k in range(8):
                tables[r, byte, k] = -s if (byte >> k) & 1 else s
    return tables


@_jit
def _averaged_at(tables, bits, count, residual, ratio, i):
    value = np.float32(0.0)
    for r in range(tables.shape[0]):
        value += tables[r, bits[r, i >> 3], i & 7]
    value /= count
    return value + residual[i] * ratio if residual.size else value


# The server's average of whole bytes: the eight values of a byte accumulate in eight lanes,
# one row's table entry at a time (2x faster than summing each element over the rows).
# _byte_sums is inlined into the loops by numba itself: as a call, the loops took 2x as long.

@_jit(inline="always")
def _byte_sums(tables, bits, j, lanes):
    """lanes[k] = the sum over rows r, in order, of the value of sign k of byte j of row r."""
    lanes[:] = 0.0
    for r in range(bits.shape[0]):
        entry = tables[r, bits[r, j]]
        for k in range(8):
            lanes[k] += entry[k]


@_jit(fastmath={"reassoc"})
def _averaged_l1(tables, bits, count, out):
    total = 0.0
    lanes = np.empty(8, dtype=np.float32)
    for j in range(bits.shape[1]):
        _byte_sums(tables, bits, j, lanes)
        for k in range(8):
            out[8 * j + k] = lanes[k] / count
            total += abs(np.float64(out[8 * j + k]))
    return total


@_jit(fastmath={"reassoc"})
def _averaged_compensated_l1(tables, bits, count, residual, ratio, out):
    total = 0.0
    lanes = np.empty(8, dtype=np.float32)
    for j in range(bits.shape[1]):
        _byte_sums(tables, bits, j, lanes)
        for k in range(8):
            out[8 * j + k] = lanes[k] / count + residual[8 * j + k] * ratio
            total += abs(np.float64(out[8 * j + k]))
    return total


@_jit
def averaged_block_l1(bits, scales, count, residual, ratio, block, out, sums):
    """The server's pass over what it serves (its shard, or the replicated server's whole
    tensor), when that lies in one block of each worker's message: out = (sum over rows r
    of sign_r scales[r]) / count + residual * ratio, the rows summed in order as the eager
    sum over rows (float32), and sums[b] = sum of |out| over the server's block b
    (float64). An empty ``residual`` means none. One pass where the average, the
    compensation and the block sums were three."""
    tables = _sign_tables(scales)
    count, ratio = np.float32(count), np.float32(ratio)
    for b in range(sums.size):
        start, stop = b * block, min(out.size, (b + 1) * block)
        # Whole bytes in lanes; elements of a byte shared with another block one by one.
        first = min(-(-start // 8) * 8, stop)
        last = max(stop // 8 * 8, first)
        body = bits[:, first // 8:last // 8]
        if residual.size:
            total = _averaged_compensated_l1(tables, body, count, residual[first:last],
                                             ratio, out[first:last])
        else:
            total = _averaged_l1(tables, body, count, out[first:last])
        for i in range(start, first):
            out[i] = _averaged_at(tables, bits, count, residual, ratio, i)
            total += abs(np.float64(out[i]))
        for i in range(last, stop):
            out[i] = _averaged_at(tables, bits, count, residual, ratio, i)
            total += abs(np.float64(out[i]))
        sums[b] = total


@_jit
def scaled_signs(bits, scales, out):
    """Row r of ``out``: the first out.shape[1] signs of row r of ``bits`` times
    scales[r] (``packing.unpack_scaled_signs``)."""
    tables = _sign_tables(scales)
    numel = out.shape[1]
    for r in range(scales.size):
        for j in range(numel // 8):
            for k in range(8):
                out[r, 8 * j + k] = tables[r, bits[r, j], k]
        for i in range(numel - numel % 8, numel):
            out[r, i] = tables[r, bits[r, i >> 3], i & 7]
