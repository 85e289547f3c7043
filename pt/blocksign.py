"""BlockSign in PyTorch ops; the algorithm and its reference are in ``hvd_compress.blocksign``."""
import torch

from hvd_compress import blocksign as reference

from .buckets import float64_sums, rescale
from .codec import Codec


class BlockSign(reference.BlockSign, Codec):
    __doc__ = reference.BlockSign.__doc__

    def local_scale(self, grad):
        p = grad.detach().reshape(-1)
        n = self.buckets(p.numel())
        d = self.bucket_length(p.numel())
        sums = float64_sums(p, d, torch.Tensor.abs_)
        sizes = torch.clamp(p.numel() - d * torch.arange(n, device=p.device), max=d)
        scale = (sums / sizes).to(torch.float32)
        # Sums propagate NaN and Inf: a non-finite scale marks the whole tensor.
        finite = torch.isfinite(scale).all()
        return torch.where(finite, scale, torch.full_like(scale, float("inf")))

    def encode(self, grad, scale, uniforms):
        # 2 [g >= 0] - 1 in int8 (a NaN compares false: -1, as the reference); a bool
        # tensor's bytes are 0 or 1, so it is read as int8 without a conversion pass.
        return (grad >= 0).view(torch.int8).mul(2).sub_(1)

    def decode(self, total, scale, count):
        return rescale(total, scale, self.bucket_length(total.shape[-1]), count)
