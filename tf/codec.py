"""Horovod's ``Compressor`` interface for every TensorFlow codec, and the stateless codecs."""

import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from hvd_compress import codec as reference


def divide(tensor, divisor):
    """tensor / divisor, rounded once as the reference rounds it, in eager mode and in
    graphs. Grappler rewrites a division by a constant into a multiplication by its
    rounded reciprocal, which differs in the last bit; it leaves ``DivNoNan`` alone (and the
    divisor is never zero here). XLA rewrites it too, for a constant divisor: ``divisor`` may
    be a tensor, which the compiled functions take as an argument (``xla_fused``)."""
    if isinstance(divisor, tf.Tensor):
        return tf.math.divide_no_nan(tensor, tf.cast(divisor, tensor.dtype))
    return tf.math.divide_no_nan(tensor, tf.constant(divisor, tensor.dtype))


class Codec(Compressor):
    """Mixin that makes a TensorFlow codec usable as Horovod's ``compression=`` argument.

    Horovod's own ``DistributedGradientTape`` and ``DistributedOptimizer`` sum whatever
    ``compress`` returns with an allreduce. That is right only for codecs whose codes are
    summable as they are (``none``, ``fp16``). A codec that needs a shared scale or per-worker
    metadata refuses, rather than letting Horovod sum codes that mean different things on
    different workers.
    """

    def compress(self, tensor):
        reason = self.why_not_horovod()
        if reason is not None:
            raise TypeError(
                f"{type(self).__name__} cannot run inside Horovod's own DistributedOptimizer "
                f"or DistributedGradientTape: {reason}. Use "
                f"hvd_compress.tf.DistributedOptimizer(optimizer, compression={self.name!r}) "
                f"or hvd_compress.tf.DistributedGradientTape(tape, compression={self.name!r})."
            )
        if self.code_space is None or not tensor.dtype.is_floating:
            return tensor, None
        return self.encode(tensor, None, None), tensor.dtype

    def decompress(self, tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class NoneCodec(reference.NoneCodec, Codec):
    __doc__ = reference.NoneCodec.__doc__


class FP16(reference.FP16, Codec):
    __doc__ = reference.FP16.__doc__

    def encode(self, grad, scale, uniforms):
        return tf.cast(grad, tf.float16)

    def decode(self, total, scale, averaged_over):
        return divide(tf.cast(total, tf.float32), averaged_over)
