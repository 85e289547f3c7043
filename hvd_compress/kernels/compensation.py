"""The worker's compensation passes: the worker momentum's step and the residual added to the
gradient, with the block sums of |p| that ef-sign's scales are taken from.
"""

import numpy as np

from .base import jit


@jit
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


@jit
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


@jit(fastmath={"reassoc"})
def _l1(p):
    total = 0.0
    for i in range(p.size):
        total += abs(np.float64(p[i]))
    return total


@jit(fastmath={"reassoc"})
def _compensated_l1(vector, residual, lr_ratio, out):
    total = 0.0
    for i in range(vector.size):
        out[i] = vector[i] + residual[i] * lr_ratio
        total += abs(np.float64(out[i]))
    return total


@jit(fastmath={"reassoc"})
def _accelerated_l1(vector, buffer, mu, nesterov, new_buffer, out):
    total = 0.0
    for i in range(vector.size):
        new_buffer[i], out[i] = _momentum_at(vector[i], buffer[i], mu, nesterov)
        total += abs(np.float64(out[i]))
    return total


@jit(fastmath={"reassoc"})
def _accelerated_compensated_l1(vector, buffer, mu, nesterov, new_buffer, residual, lr_ratio, out):
    total = 0.0
    for i in range(vector.size):
        new_buffer[i], u = _momentum_at(vector[i], buffer[i], mu, nesterov)
        out[i] = u + residual[i] * lr_ratio
        total += abs(np.float64(out[i]))
    return total


@jit
def compensated_block_l1(
    vector, buffer, mu, nesterov, new_buffer, residual, lr_ratio, block, out, sums
):
    """out = u + residual * lr_ratio (float32), and sums[b] = sum of |out| over block b
    (float64). u is ``vector``, or with a momentum ``buffer`` the u of ``_momentum_at``,
    whose m goes to ``new_buffer``. Empty ``buffer`` and ``residual`` mean none; with
    neither, out is not written and the sums are of ``vector``."""
    lr_ratio = np.float32(lr_ratio)
    for b in range(sums.size):
        s = slice(b * block, min(vector.size, (b + 1) * block))
        if buffer.size and residual.size:
            sums[b] = _accelerated_compensated_l1(
                vector[s], buffer[s], mu, nesterov, new_buffer[s], residual[s], lr_ratio, out[s]
            )
        elif buffer.size:
            sums[b] = _accelerated_l1(vector[s], buffer[s], mu, nesterov, new_buffer[s], out[s])
        elif residual.size:
            sums[b] = _compensated_l1(vector[s], residual[s], lr_ratio, out[s])
        else:
            sums[b] = _l1(vector[s])
