"""BlockSign in PyTorch ops; the algorithm and its reference are in ``hvd_compress.blocksign``."""
import torch

from hvd_compress import blocksign as reference

from .buckets import pieces, rescale
from .codec import Codec

# Elements converted to float64 at a time for the block sums on a CPU: a cache-sized
# buffer made the scale of a 25M-parameter model's gradients 3x cheaper than one
# gradient-sized float64 copy. A GPU converts the whole tensor in one launch instead.
_CPU_CHUNK = 1 << 17


def block_l1(p, d):
    """sum |p_i| over each block of ``d`` elements of the 1-D ``p``, in float64."""
    numel = p.numel()
    chunk = _CPU_CHUNK if p.device.type == "cpu" else max(numel, 1)
    sums = torch.zeros(-(-numel // d), dtype=torch.float64, device=p.device)
    buffer = torch.empty(min(chunk, numel), dtype=torch.float64, device=p.device)
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        magnitude = buffer[: stop - start].copy_(p[start:stop]).abs_()
        for elements, rows, blocks in pieces(start, stop, d):
            sums[blocks] += magnitude[elements].reshape(rows, -1).sum(dim=1)
    return sums


class BlockSign(reference.BlockSign, Codec):
    __doc__ = reference.BlockSign.__doc__

    def local_scale(self, grad):
        p = grad.detach().reshape(-1)
        n = self.buckets(p.numel())
        d = self.bucket_length(p.numel())
        sums = block_l1(p, d)
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
