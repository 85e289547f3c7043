"""TernGrad in TensorFlow ops; the algorithm and its reference are in ``hvd_compress.terngrad``."""

import tensorflow as tf

from hvd_compress import terngrad as reference

from . import fused
from .quantizer import UniformQuantizer


class TernGrad(reference.TernGrad, UniformQuantizer):
    __doc__ = reference.TernGrad.__doc__

    def local_scale(self, grad):
        if fused.applies(self, grad):
            return fused.local_scale(self, grad)
        g = tf.reshape(tf.cast(grad, tf.float32), [-1])
        amax = tf.reduce_max(tf.abs(g))
        if self.clip == 0:
            scale = amax
        else:
            # The reference's float64 sums of d = g - g[0] (``terngrad.shifted_variance``):
            # float32 sums of millions of elements drift from it in the last bits.
            g64 = tf.cast(g, tf.float64)
            d = g64 - g64[:1]
            total, count = tf.reduce_sum(d), tf.cast(tf.size(d), tf.float64)
            squares = tf.reduce_sum(tf.square(d))
            sigma = tf.sqrt(tf.maximum(squares - total * total / count, 0.0) / count)
            scale = tf.minimum(self.clip * tf.cast(sigma, tf.float32), amax)
        # +inf flags a non-finite gradient to the Max; the max propagates NaN and Inf, so it
        # tells without another pass over the gradient.
        return tf.reshape(tf.where(tf.math.is_finite(amax), scale, float("inf")), [1])
