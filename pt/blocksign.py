"""BlockSign in PyTorch ops; the algorithm and its reference are in ``hvd_compress.blocksign``."""

import torch

from hvd_compress import blocksign as reference

from .buckets import Segments, float64_sums, rescale
from .codec import Codec


class BlockSign(reference.BlockSign, Codec):
    __doc__ = reference.BlockSign.__doc__

    def local_scale(self, grad):
        # The reference's float64 sums: float32 sums of |p| round differently in the last
        # bit of one scale in a dozen.
        p = grad.detach().reshape(-1)
        sums = float64_sums(p, self.bucket_length(p.numel()), torch.Tensor.abs_)
        return self.scale_from_sums(sums, p.numel())

    def scale_from_sums(self, sums, numel):
        """The float32 block scales of ``numel`` elements from their float64 sums of |p|
        per block (``local_scale``'s, or those a fused kernel accumulated)."""
        d = self.bucket_length(numel)
        if isinstance(d, Segments):
            scale = (sums / d.block_lengths).to(torch.float32)
            # A non-finite scale marks its whole member.
            return torch.where(d.whole_groups(~torch.isfinite(scale)), float("inf"), scale)
        scale = sums / d
        if numel % d:  # the last block is shorter
            scale[-1] = sums[-1] / (numel % d)
        scale = scale.to(torch.float32)
        # Sums propagate NaN and Inf: a non-finite scale marks the whole tensor. (Sums of
        # |p| are never -inf, so one block only has NaN to turn into inf.)
        if scale.numel() == 1:
            return scale.nan_to_num_(nan=float("inf"), posinf=float("inf"))
        return torch.where(torch.isfinite(scale).all(), scale, float("inf"))

    def encode(self, grad, scale, uniforms):
        # 2 [g >= 0] - 1 in int8 (a NaN compares false: -1, as the reference); a bool
        # tensor's bytes are 0 or 1, so it is read as int8 without a conversion pass.
        return (grad >= 0).view(torch.int8).mul_(2).sub_(1)

    def decode(self, total, scale, averaged_over):
        return rescale(total, scale, self.bucket_length(total.shape[-1]), averaged_over)
