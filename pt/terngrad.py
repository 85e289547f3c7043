"""TernGrad in PyTorch ops; the algorithm and its reference are in ``hvd_compress.terngrad``."""

import torch

from hvd_compress import terngrad as reference

from . import fused
from .buckets import Segments
from .quantizer import UniformQuantizer


class TernGrad(reference.TernGrad, UniformQuantizer):
    __doc__ = reference.TernGrad.__doc__

    def local_scale(self, grad):
        if fused.on_host(self, grad):
            return fused.local_scale(self, grad)
        g = grad.detach().reshape(-1).to(torch.float32)
        blocks = self.bucket_length(g.numel())
        if isinstance(blocks, Segments):
            return self._member_scales(g, blocks)
        if g.numel() == 0:
            return g.new_zeros(1)
        amax = g.abs().max()
        if self.clip == 0:
            scale = amax
        else:
            # The reference's float64 sums of d = g - g[0] (``terngrad.shifted_variance``):
            # torch.var_mean's float32 algorithm is several times slower, and less exact.
            d = g.to(torch.float64)
            d -= d[:1].clone()
            total, count = d.sum(), g.numel()
            variance = (torch.dot(d, d) - total * total / count).clamp_(min=0) / count
            sigma = variance.sqrt().to(torch.float32)
            scale = torch.minimum(self.clip * sigma, amax)
        # Kept on the device (no .item()): +inf flags a non-finite gradient to the Max. The
        # max propagates NaN and Inf, so it tells without another pass over the gradient.
        finite = torch.isfinite(amax)
        return torch.where(finite, scale, torch.full_like(scale, float("inf"))).reshape(1)

    def _member_scales(self, g, members):
        """``local_scale`` of each member of a gradient bucket (one block each): the same
        maximum, and float64 sums of d = g - g[0] over each member's elements."""
        amax = members.reduce(g.abs(), "amax")
        if self.clip == 0:
            scale = amax
        else:
            d = g.to(torch.float64)
            d -= members.expand(d.index_select(0, members.starts))
            total, count = members.reduce(d, "sum"), members.block_lengths.to(torch.float64)
            variance = (members.reduce(d * d, "sum") - total * total / count).clamp_(min=0)
            sigma = (variance / count).sqrt().to(torch.float32)
            scale = torch.minimum(self.clip * sigma, amax)
        finite = torch.isfinite(amax)
        return torch.where(finite, scale, torch.full_like(scale, float("inf")))
