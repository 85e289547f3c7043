"""Unbiased stochastic rounding to uniform levels: the quantizer shared by TernGrad, QSGD
and QSGD-inf.

Per bucket with scale S and s levels, r = |g| / S in [0, 1] (S >= max|g| of the bucket):

    x = r * s,  l = min(floor(x), s - 1),  p = x - l
    level = l + 1 with probability p, else l        (E[level / s] = r)
    code = sign(g) * level                           in [-s, s]
    g_hat = S * sum of codes / (s * count)

With a shared S (the Max over workers) the codes of all workers are summable integers.
"""

import numpy as np

from . import buckets
from .codec import Codec
from .codes import IntCodes


class UniformQuantizer(Codec):
    """Base class: subclasses set ``levels`` (s) and ``bucket_size`` (None: one bucket per
    tensor) and define ``local_scale``."""

    summable = True
    scaled = True
    stochastic = True
    levels = 1

    @property
    def code_space(self):
        return IntCodes(self.levels)

    def rounding(self, grad, scale):
        """``(lo, hi, p)``: the two levels around r = |g| / S and the probability of hi."""
        r = buckets.normalized(grad, scale, self.bucket_length(grad.shape[-1]))
        x = r * np.float32(self.levels)
        low = np.minimum(np.floor(x), np.float32(self.levels - 1))
        return low, low + 1, x - low

    def encode(self, grad, scale, uniforms):
        low, _, p = self.rounding(grad, scale)
        level = low + (uniforms < p)
        return (np.sign(grad) * level).astype(np.int8)

    def decode(self, total, scale, averaged_over):
        return buckets.rescale(
            total, scale, self.bucket_length(total.shape[-1]), self.levels * averaged_over
        )
