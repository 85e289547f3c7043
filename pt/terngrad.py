"""TernGrad in PyTorch ops; the algorithm and its reference are in ``hvd_compress.terngrad``."""

import torch

from hvd_compress import terngrad as reference

from . import fused
from .quantizer import UniformQuantizer


class TernGrad(reference.TernGrad, UniformQuantizer):
    __doc__ = reference.TernGrad.__doc__

    def local_scale(self, grad):
        if fused.applies(self, grad):
            return fused.local_scale(self, grad)
        g = grad.detach().reshape(-1).to(torch.float32)
        if g.numel() == 0:
            return g.new_zeros(1)
        amax = g.abs().max()
        if self.clip == 0:
            scale = amax
        else:
            # Two passes in float64, as the reference: torch.var_mean's one-pass float32
            # algorithm is several times slower, and less exact.
            centered = g.to(torch.float64)
            centered -= centered.mean()
            sigma = (torch.dot(centered, centered) / g.numel()).sqrt().to(torch.float32)
            scale = torch.minimum(self.clip * sigma, amax)
        # Kept on the device (no .item()): +inf flags a non-finite gradient to the Max. The
        # max propagates NaN and Inf, so it tells without another pass over the gradient.
        finite = torch.isfinite(amax)
        return torch.where(finite, scale, torch.full_like(scale, float("inf"))).reshape(1)
