"""The uniform stochastic quantizer in TensorFlow ops; see ``hvd_compress.quantizer``."""

import tensorflow as tf

from hvd_compress import quantizer as reference

from .buckets import normalized, rescale
from .codec import Codec


class UniformQuantizer(reference.UniformQuantizer, Codec):
    __doc__ = reference.UniformQuantizer.__doc__

    def rounding(self, grad, scale):
        r = normalized(grad, scale, self.bucket_length(grad.shape[-1]))
        # r <= 1, so the minimum changes nothing; it keeps XLA (``xla_fused``) from
        # contracting x and x - low into one fused multiply-add, rounded once.
        x = tf.minimum(r * float(self.levels), float(self.levels))
        low = tf.minimum(tf.floor(x), float(self.levels - 1))
        return low, low + 1, x - low

    def encode(self, grad, scale, uniforms):
        low, _, p = self.rounding(grad, scale)
        level = low + tf.cast(uniforms < p, tf.float32)
        return tf.cast(tf.sign(grad) * level, tf.int8)

    def decode(self, total, scale, averaged_over):
        return rescale(
            total, scale, self.bucket_length(total.shape[-1]), self.levels * averaged_over
        )
