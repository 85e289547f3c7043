"""Horovod's ``Compressor`` interface for every PyTorch codec, and the stateless codecs."""

import torch
from horovod.torch.compression import Compressor

from hvd_compress import codec as reference


class Codec(Compressor):
    """Mixin that makes a PyTorch codec usable as Horovod's ``compression=`` argument.

    Horovod's own ``DistributedOptimizer`` sums whatever ``compress`` returns with an
    allreduce. That is right only for codecs whose codes are summable as they are (``none``,
    ``fp16``). A codec that needs a shared scale or per-worker metadata refuses, rather than
    letting Horovod sum codes that mean different things on different workers.
    """

    def compress(self, tensor):
        reason = self.why_not_horovod()
        if reason is not None:
            raise TypeError(
                f"{type(self).__name__} cannot run inside Horovod's own DistributedOptimizer: "
                f"{reason}. Use hvd_compress.pt.DistributedOptimizer(optimizer, compression="
                f"{self.name!r}) instead."
            )
        if self.code_space is None or not tensor.is_floating_point():
            return tensor, None
        return self.encode(tensor, None, None), tensor.dtype

    def decompress(self, tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class NoneCodec(reference.NoneCodec, Codec):
    __doc__ = reference.NoneCodec.__doc__


class FP16(reference.FP16, Codec):
    __doc__ = reference.FP16.__doc__

    def encode(self, grad, scale, uniforms):
        return grad.to(torch.float16)

    def decode(self, total, scale, averaged_over):
        return total.to(torch.float32) / averaged_over
