"""QSGD, QSGD-inf and NUQSGD in PyTorch ops; see ``hvd_compress.qsgd``."""

import torch

from hvd_compress import qsgd as reference

from . import fused
from .buckets import Segments, float64_sums, normalized, reduce, rescale
from .codec import Codec
from .quantizer import UniformQuantizer


def _local_norms(quantizer, grad, norm):
    if fused.on_host(quantizer, grad):
        return fused.local_scale(quantizer, grad)
    g = grad.detach().reshape(-1)
    d = quantizer.bucket_length(g.numel())
    if norm == "l2":
        squares = float64_sums(g.to(torch.float32), d, torch.Tensor.square_)
        scale = squares.sqrt().to(torch.float32)
    else:
        # |g| in g's own dtype is exact, and rounding to float32 keeps the maximum.
        scale = reduce(g.abs(), d, "amax").to(torch.float32)
    # Sums and maxima propagate NaN and Inf: a non-finite scale marks the whole tensor (in
    # a gradient bucket, the whole member).
    finite = torch.isfinite(scale)
    finite = ~d.whole_groups(~finite) if isinstance(d, Segments) else finite.all()
    return torch.where(finite, scale, torch.full_like(scale, float("inf")))


class QSGD(reference.QSGD, UniformQuantizer):
    __doc__ = reference.QSGD.__doc__

    def local_scale(self, grad):
        return _local_norms(self, grad, self.norm)


class QSGDInf(reference.QSGDInf, QSGD):
    __doc__ = reference.QSGDInf.__doc__


class NUQSGD(reference.NUQSGD, Codec):
    __doc__ = reference.NUQSGD.__doc__

    def local_scale(self, grad):
        return _local_norms(self, grad, "l2")

    def rounding(self, grad, scale):
        r = normalized(grad, scale, self.bucket_length(grad.shape[-1]))
        _, exponent = torch.frexp(r)
        s = self.exponent
        index = torch.clamp(exponent + s, 0, s)
        index = torch.where(r > 0, index, torch.zeros_like(index))
        one = torch.ones_like(r)
        lo = torch.where(index > 0, torch.ldexp(one, index - s - 1), torch.zeros_like(r))
        hi = torch.ldexp(one, index - s)
        return lo, hi, (r - lo) / (hi - lo), index.to(torch.float32)

    def encode(self, grad, scale, uniforms):
        lo, hi, p, index = self.rounding(grad, scale)
        # As in ``UniformQuantizer.encode``: no float + bool, and copysign for the sign.
        index = index.add_((uniforms < p).to(torch.int8).to(torch.float32))
        return torch.copysign(index, grad).to(torch.int8)

    def values(self, codes):
        index = codes.to(torch.int32).abs()
        magnitude = torch.where(
            index > 0,
            torch.bitwise_left_shift(torch.ones_like(index), (index - 1).clamp(min=0)),
            torch.zeros_like(index),
        )
        return torch.sign(codes).to(torch.int32) * magnitude

    def decode(self, total, scale, averaged_over):
        length = self.bucket_length(total.shape[-1])
        return rescale(total, scale, length, 2**self.exponent * averaged_over)
