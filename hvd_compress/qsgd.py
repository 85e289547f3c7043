"""QSGD (Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NIPS 2017), its max-norm variant QSGD-inf, and NUQSGD (Ramezani-Kebrya et al.,
"NUQSGD: Provably Communication-Efficient Data-Parallel SGD via Nonuniform Quantization",
JMLR 2021).

All three cut the flattened tensor into buckets of d elements with one float32 scale each and
round r = |g| / scale stochastically and without bias to one of a few levels:

``qsgd``      scale = ||bucket||_2, levels {0, 1/s, ..., 1}
``qsgd-inf``  scale = max|bucket|,  levels {0, 1/s, ..., 1} (what practice uses)
``nuqsgd``    scale = ||bucket||_2, levels {0, 2^-s, ..., 1/4, 1/2, 1}

A b-bit code is a sign and b - 1 bits of level: s = 2^(b-1) - 1 uniform levels, or for NUQSGD
the level index 0..s+1 with s = 2^(b-1) - 2. QSGD's variance bound (Lemma 3.1) is
E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2; NUQSGD's levels, dense near zero where
most normalized coordinates are, give E||Q(v) - v||^2 <= (1/8 + min(d 4^-s / 4, sqrt(d) 2^-s))
||v||^2 (our derivation, see ``nuqsgd_variance_bound``).

Summing codes needs one scale for all workers: the shared-scale variant takes each bucket's
Max over workers (still unbiased, since every |g| <= the shared scale; more variance, measured
in the README). On an allgather each worker's own scales travel with its codes instead.
NUQSGD's level indices are not additive; their values 2^s * level = 2^(index - 1) are integers
in [-2^s, 2^s], which are.
"""

from __future__ import annotations

import math

import numpy as np

from . import buckets
from .codec import Codec
from .codes import IntCodes
from .quantizer import UniformQuantizer
from .validation import check_choice, check_int


def _local_norms(quantizer, grad, norm):
    g = grad.astype(np.float32).ravel()
    n = quantizer.buckets(g.size)
    if not np.isfinite(g).all():
        return np.full(n, np.inf, np.float32)
    d = quantizer.bucket_length(g.size)
    if norm == "l2":
        squares = buckets.reduce(np.square(g.astype(np.float64)), d, np.sum)
        return np.sqrt(squares).astype(np.float32)
    return buckets.reduce(np.abs(g), d, np.max).astype(np.float32)


class _BucketedQuantizer:
    """Hyperparameters shared by the three codecs."""

    default_min_size = 10000

    max_bits = 8

    def _init_bits(self, bits, bucket_size, wire):
        owner = type(self).__name__
        self.bits = check_int(owner, "bits", bits, low=2, high=self.max_bits)
        self.bucket_size = check_int(owner, "bucket_size", bucket_size, low=1)
        self.wire = check_choice(owner, "wire", wire, ("fixed", "elias"))

    @property
    def summable(self):
        # Variable-length codes cannot be summed in place; they travel by allgather.
        return self.wire == "fixed"

    def shares_scale(self, exchange):
        return exchange != "allgather"


class QSGD(_BucketedQuantizer, UniformQuantizer):
    """QSGD with the L2 norm of each bucket as its scale.

    Args:
        bits (int): b, bits per element on the wire: a sign and b - 1 bits of level, so
            s = 2^(b-1) - 1 levels (4 bits: s = 7). 2 to 8. Default 4, the paper's setting for
            AlexNet and ResNet-50 on ImageNet.
        bucket_size (int): d, elements per bucket (one float32 scale each). Default 512, the
            paper's bucket for 4 and 8 bits (128 for 2 bits); bucket 8192 at 4 bits lost 0.68
            points of top-1 on AlexNet.
        min_size (int): tensors with fewer elements are sent as float32; the paper leaves
            tensors under 10,000 elements unquantized. Default 10000.
        compress_classifier (bool): quantize the classifier layer too. Default True.
        wire (str): ``"fixed"``, b bits per element packed (any exchange), or ``"elias"``,
            only the nonzero codes as Elias-omega coded gaps, signs and levels (QSGD's
            Section 3.2; allgather only). Default ``"fixed"``.
    """

    name = "qsgd"
    norm = "l2"

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 512,
        *,
        min_size: int | None = None,
        compress_classifier: bool | None = None,
        wire: str = "fixed",
    ) -> None:
        super().__init__(min_size=min_size, compress_classifier=compress_classifier)
        self._init_bits(bits, bucket_size, wire)

    @property
    def levels(self):
        return 2 ** (self.bits - 1) - 1

    def local_scale(self, grad):
        return _local_norms(self, grad, self.norm)


class QSGDInf(QSGD):
    """QSGD with the max norm (L-infinity) of each bucket as its scale: the variant used in
    the QSGD paper's experiments and by the NUQSGD authors' code.

    Args:
        bits (int): b, 2 to 8; s = 2^(b-1) - 1 levels. Default 4.
        bucket_size (int): d, elements per bucket. Default 512 (QSGD paper, 4 bits).
        min_size (int): default 10000 (QSGD paper).
        compress_classifier (bool): default True.
        wire (str): ``"fixed"``, b bits per element packed (any exchange), or ``"elias"``,
            only the nonzero codes as Elias-omega coded gaps, signs and levels (QSGD's
            Section 3.2; allgather only). Default ``"fixed"``.
    """

    name = "qsgd-inf"
    norm = "max"


class NUQSGD(_BucketedQuantizer, Codec):
    """NUQSGD: nonuniform levels {0, 2^-s, ..., 1/2, 1} on L2-normalized buckets.

    Args:
        bits (int): b, 2 to 5: a sign and b - 1 bits of level index, so s = 2^(b-1) - 2
            (4 bits: s = 6, levels 0, 1/64, ..., 1/2, 1). Default 4, as in the authors'
            experiment grid. Beyond 5 bits the smallest level, 2^-(2^(b-1) - 2), is 2^-30 or
            less, and the summable values 2^(index - 1) overflow 32-bit sums.
        bucket_size (int): d, elements per bucket. Default 8192, the authors' grid.
        min_size (int): default 10000, as for QSGD.
        compress_classifier (bool): default True.
        wire (str): ``"fixed"``, b bits per element packed (any exchange), or ``"elias"``,
            only the nonzero codes as Elias-omega coded gaps, signs and levels (QSGD's
            Section 3.2; allgather only). Default ``"fixed"``.
    """

    name = "nuqsgd"
    max_bits = 5
    scaled = True
    stochastic = True

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 8192,
        *,
        min_size: int | None = None,
        compress_classifier: bool | None = None,
        wire: str = "fixed",
    ) -> None:
        super().__init__(min_size=min_size, compress_classifier=compress_classifier)
        self._init_bits(bits, bucket_size, wire)

    @property
    def exponent(self):
        """s: the smallest nonzero level is 2^-s."""
        return 2 ** (self.bits - 1) - 2

    @property
    def code_space(self):
        return IntCodes(self.exponent + 1)

    @property
    def value_space(self):
        return IntCodes(2**self.exponent)

    def local_scale(self, grad):
        return _local_norms(self, grad, "l2")

    def rounding(self, grad, scale):
        """``(lo, hi, p)`` around r = |g| / scale, and the index of lo, as float32."""
        r = buckets.normalized(grad, scale, self.bucket_length(grad.shape[-1]))
        # Index j of the level below r: l_j = 2^(j - s - 1) <= r, from the binary exponent
        # (exact, unlike a floating-point log2); j = 0 below 2^-s.
        _, exponent = np.frexp(r)
        s = self.exponent
        index = np.clip(exponent + s, 0, s).astype(np.float32)
        index = np.where(r > 0, index, np.float32(0))
        lo = np.where(
            index > 0, np.ldexp(np.float32(1), (index - s - 1).astype(np.int32)), np.float32(0)
        ).astype(np.float32)
        hi = np.ldexp(np.float32(1), (index - s).astype(np.int32)).astype(np.float32)
        return lo, hi, (r - lo) / (hi - lo), index

    def encode(self, grad, scale, uniforms):
        lo, hi, p, index = self.rounding(grad, scale)
        index = index + (uniforms < p)
        return (np.sign(grad) * index).astype(np.int8)

    def values(self, codes):
        index = np.abs(codes.astype(np.int32))
        magnitude = np.where(index > 0, np.left_shift(1, np.maximum(index - 1, 0)), 0)
        return np.sign(codes).astype(np.int32) * magnitude

    def decode(self, total, scale, averaged_over):
        return buckets.rescale(
            total, scale, self.bucket_length(total.shape[-1]), 2**self.exponent * averaged_over
        )


def qsgd_variance_bound(d, s):
    """Lemma 3.1 of QSGD: E||Q(v) - v||^2 / ||v||^2 <= min(d / s^2, sqrt(d) / s)."""
    return min(d / s**2, math.sqrt(d) / s)


def nuqsgd_variance_bound(d, s):
    """E||Q(v) - v||^2 / ||v||^2 for NUQSGD's levels: on a doubling interval [l, 2l] the
    rounding variance (r - l)(2l - r) is at most r^2 / 8; below 2^-s it is at most
    min(2^-s r, 4^-s / 4), and sum r <= sqrt(d), sum r^2 = 1 for an L2-normalized bucket."""
    return 1 / 8 + min(d * 4.0**-s / 4, math.sqrt(d) * 2.0**-s)
