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

The kernels by family: ``compensation`` (the worker's momentum and residual), ``signs``
(ef-sign), ``quantizers`` (TernGrad's and the QSGD family's scales and codes) and
``decoders`` (their sums and decodes), on ``base`` (the jit options and what the loops
share). The names below are what ``hvd_compress.fused`` calls.
"""

from .compensation import compensated_block_l1, momentum
from .decoders import (
    decoded_own_scales,
    decoded_segments,
    decoded_sums,
    decoded_totals,
    summed_codes,
)
from .quantizers import (
    GIVEN_SCALES,
    L2_NORMS,
    MAX_NORMS,
    bucket_squares,
    bucket_tops,
    draws,
    quantized,
    shifted_moments_and_top,
)
from .signs import averaged_block_l1, scaled_signs, signs_with_feedback

__all__ = [
    "GIVEN_SCALES",
    "L2_NORMS",
    "MAX_NORMS",
    "averaged_block_l1",
    "bucket_squares",
    "bucket_tops",
    "compensated_block_l1",
    "decoded_own_scales",
    "decoded_segments",
    "decoded_sums",
    "decoded_totals",
    "draws",
    "momentum",
    "quantized",
    "scaled_signs",
    "shifted_moments_and_top",
    "signs_with_feedback",
    "summed_codes",
]
