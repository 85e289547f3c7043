"""The uniform stochastic quantizer in PyTorch ops; see ``hvd_compress.quantizer``."""

import torch

from hvd_compress import quantizer as reference

from .buckets import normalized_unclipped, rescale
from .codec import Codec


class UniformQuantizer(reference.UniformQuantizer, Codec):
    __doc__ = reference.UniformQuantizer.__doc__

    def _low_and_p(self, grad, scale):
        """``rounding``'s low level and p, but with r not clipped to 1: where r > 1, p > 1
        (where the reference has p = 1), which draws the same level, low + 1, and saves a
        pass. A NaN r (non-finite g) is 0, as the reference's."""
        x = normalized_unclipped(grad, scale, self.bucket_length(grad.shape[-1])).nan_to_num_(
            nan=0.0
        )
        if self.levels != 1:
            x.mul_(float(self.levels))
        low = torch.floor(x).clamp_(max=float(self.levels - 1))
        return low, x.sub_(low)

    def rounding(self, grad, scale):
        low, p = self._low_and_p(grad, scale)
        return low, low + 1, p.clamp_(max=1.0)

    def encode(self, grad, scale, uniforms):
        if self.levels == 1:
            # One level: low = 0 and p = r, and an unclipped r >= 1 draws level 1 as r = 1
            # does (uniforms < 1); a NaN r (non-finite g) draws 0, as the reference's r = 0.
            drawn = uniforms < normalized_unclipped(grad, scale, self.bucket_length(grad.shape[-1]))
            level = drawn.to(torch.int8).to(torch.float32)
        else:
            low, p = self._low_and_p(grad, scale)
            # Comparisons give bool, and float + bool takes a slow mixed-type path: the
            # draws go through int8 to float32.
            level = low.add_((uniforms < p).to(torch.int8).to(torch.float32))
        # sign(g) * level: copysign keeps one pass and, as level is 0 wherever g is 0 or
        # NaN, gives the same codes.
        return torch.copysign(level, grad).to(torch.int8)

    def decode(self, total, scale, averaged_over):
        return rescale(
            total, scale, self.bucket_length(total.shape[-1]), self.levels * averaged_over
        )
