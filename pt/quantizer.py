"""The uniform stochastic quantizer in PyTorch ops; see ``hvd_compress.quantizer``."""
import torch

from hvd_compress import quantizer as reference

from .buckets import normalized, rescale
from .codec import Codec


class UniformQuantizer(reference.UniformQuantizer, Codec):
    __doc__ = reference.UniformQuantizer.__doc__

    def rounding(self, grad, scale):
        r = normalized(grad, scale, self.bucket_length(grad.shape[-1]))
        x = r * float(self.levels)
        low = torch.clamp(torch.floor(x), max=float(self.levels - 1))
        return low, low + 1, x - low

    def encode(self, grad, scale, uniforms):
        low, _, p = self.rounding(grad, scale)
        level = low + (uniforms < p)
        return (torch.sign(grad) * level).to(torch.int8)

    def decode(self, total, scale, count):
        return rescale(total, scale, self.bucket_length(total.shape[-1]), self.levels * count)
