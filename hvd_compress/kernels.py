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


# reassoc lets the float64 sums of |p| run in vector lanes (3x faster; they stay within
# float64 rounding of the reference's). It reorders nothing else: each kernel's float32
# arithmetic is one operation per element, rounded as the eager op rounds it.
@_jit(fastmath={"reassoc"})
def compensated_block_l1(vector, buffer, mu, nesterov, new_buffer, residual, ratio, block,
                         out, sums):
    """out = u + residual * ratio (float32), and sums[b] = sum of |out| over block b
    (float64). u is ``vector``, or with a momentum ``buffer`` the u of ``_momentum_at``,
    whose m goes to ``new_buffer``. Empty ``buffer`` and ``residual`` mean none; with
    neither, out is not written and the sums are of ``vector``. ``out`` may be
    ``vector`` itself."""
    ratio, mu = np.float32(ratio), np.float64(np.float32(mu))
    accelerate, compensate = buffer.size > 0, residual.size > 0
    for b in range(sums.size):
        total = 0.0
        for i in range(b * block, min(vector.size, (b + 1) * block)):
            value = vector[i]
            if accelerate:
                new_buffer[i], value = _momentum_at(value, buffer[i], mu, nesterov)
            if compensate:
                value = value + residual[i] * ratio
            if accelerate or compensate:
                out[i] = value
            total += abs(np.float64(value))
        sums[b] = total


@_jit
def signs_with_feedback(p, scale, block, packed, residual):
    """One BlockSign message with error feedback: the packed signs of ``p`` and the
    residual p - sign(p) scale[b] of each block b (NaN where the scale is not finite, as
    the eager decode gives). ``packed`` holds at least ceil(p.size / 8) bytes; the bits
    of a last partial byte past p.size are 0 (+1, cut off by every receiver)."""
    for b in range(scale.size):
        s = scale[b] if np.isfinite(scale[b]) else np.float32(np.nan)
        for i in range(b * block, min(p.size, (b + 1) * block)):
            residual[i] = p[i] - (s if p[i] >= 0 else -s)
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
def averaged_signs(bits, scales, count, out):
    """out = (sum over rows r of sign_r scales[r]) / count for the first out.size signs of
    each row of ``bits``, summed in row order as the eager sum over rows: the sharded
    server's average of its workers' messages when its shard lies in one block of each."""
    tables = _sign_tables(scales)
    count = np.float32(count)
    for j in range((out.size + 7) // 8):
        for k in range(min(8, out.size - 8 * j)):
            value = np.float32(0.0)
            for r in range(scales.size):
                value += tables[r, bits[r, j], k]
            out[8 * j + k] = value / count


@_jit
def scaled_signs(bits, scales, out):
    """Row r of ``out``: the first out.shape[1] signs of row r of ``bits`` times
    scales[r] (``packing.unpack_scaled_signs``)."""
    tables = _sign_tables(scales)
    for r in range(scales.size):
        for j in range((out.shape[1] + 7) // 8):
            for k in range(min(8, out.shape[1] - 8 * j)):
                out[r, 8 * j + k] = tables[r, bits[r, j], k]
