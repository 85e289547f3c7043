"""QSGD, QSGD-inf and NUQSGD in TensorFlow ops; see ``hvd_compress.qsgd``."""

import tensorflow as tf

from hvd_compress import qsgd as reference

from . import fused
from .buckets import normalized, reduce, rescale
from .codec import Codec
from .quantizer import UniformQuantizer


def _local_norms(quantizer, grad, norm):
    if fused.applies(quantizer, grad):
        return fused.local_scale(quantizer, grad)
    g = tf.reshape(tf.cast(grad, tf.float32), [-1])
    d = quantizer.bucket_length(g.shape[0])
    if norm == "l2":
        scale = tf.cast(tf.sqrt(reduce(tf.square(tf.cast(g, tf.float64)), d, "sum")), tf.float32)
    else:
        scale = reduce(tf.abs(g), d, "max")
    # Sums and maxima propagate NaN and Inf: a non-finite scale marks the whole tensor.
    finite = tf.reduce_all(tf.math.is_finite(scale))
    return tf.where(finite, scale, float("inf"))


def _binary_exponent(r):
    """e with r = m 2^e, m in [0.5, 1), of positive normal float32 values (``frexp``, which
    TensorFlow lacks), read from the bits: exact."""
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.bitcast(r, tf.int32), 23), 0xFF) - 126


def _power_of_two(exponent):
    """2^exponent as float32 for integer exponents in the normal range (``ldexp``)."""
    return tf.bitcast(tf.bitwise.left_shift(tf.cast(exponent, tf.int32) + 127, 23), tf.float32)


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
        s = self.exponent
        # Subnormal r (below 2^-126) read a wrong exponent, but it clips to index 0 anyway.
        index = tf.clip_by_value(_binary_exponent(r) + s, 0, s)
        index = tf.where(r > 0, index, 0)
        lo = tf.where(index > 0, _power_of_two(index - s - 1), 0.0)
        hi = _power_of_two(index - s)
        return lo, hi, (r - lo) / (hi - lo), tf.cast(index, tf.float32)

    def encode(self, grad, scale, uniforms):
        lo, hi, p, index = self.rounding(grad, scale)
        index = index + tf.cast(uniforms < p, tf.float32)
        return tf.cast(tf.sign(grad) * index, tf.int8)

    def values(self, codes):
        index = tf.abs(tf.cast(codes, tf.int32))
        magnitude = tf.where(index > 0, tf.bitwise.left_shift(1, tf.maximum(index - 1, 0)), 0)
        return tf.sign(tf.cast(codes, tf.int32)) * magnitude

    def decode(self, total, scale, averaged_over):
        length = self.bucket_length(total.shape[-1])
        return rescale(total, scale, length, 2**self.exponent * averaged_over)
