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
            # float64 moments, as in the reference: float32 sums of millions of elements
            # drift from it in the last bits.
            g64 = tf.cast(g, tf.float64)
            sigma = tf.sqrt(tf.reduce_mean(tf.square(g64 - tf.reduce_mean(g64))))
            scale = tf.minimum(self.clip * tf.cast(sigma, tf.float32), amax)
        # +inf flags a non-finite gradient to the Max; the max propagates NaN and Inf, so it
        # tells without another pass over the gradient.
        return tf.reshape(tf.where(tf.math.is_finite(amax), scale, float("inf")), [1])
