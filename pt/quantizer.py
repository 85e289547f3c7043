"""The uniform stochastic quantizer in PyTorch ops; see ``hvd_compress.quantizer``."""
import torch

from hvd_compress import quantizer as reference

from .buckets import expand
from .codec import Codec


class UniformQuantizer(reference.UniformQuantizer, Codec):
    __doc__ = reference.UniformQuantizer.__doc__

    def rounding(self, grad, scale):
        numel = grad.shape[-1]
        full = expand(torch.as_tensor(scale, dtype=torch.float32, device=grad.device).reshape(-1),
                      numel, self.bucket_length(numel))
        usable = (full > 0) & torch.isfinite(full)
        r = torch.where(usable, grad.abs().to(torch.float32) / full, torch.zeros_like(full))
        x = torch.clamp(r, max=1.0) * float(self.levels)
        low = torch.clamp(torch.floor(x), max=float(self.levels - 1))
        return low, low + 1, x - low

    def encode(self, grad, scale, uniforms):
        low, _, p = self.rounding(grad, scale)
        level = low + (uniforms < p)
        return (torch.sign(grad) * level).to(torch.int8)

    def decode(self, total, scale, count):
        numel = total.shape[-1]
        full = expand(torch.as_tensor(scale, dtype=torch.float32, device=total.device),
                      numel, self.bucket_length(numel))
        value = full * total.to(torch.float32) / float(self.levels * count)
        return torch.where(torch.isfinite(full), value, torch.full_like(value, float("nan")))
