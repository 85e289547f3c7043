"""BlockSign in TensorFlow ops; the algorithm and its reference are in
``hvd_compress.blocksign``."""

import tensorflow as tf

from hvd_compress import blocksign as reference

from .buckets import reduce, rescale
from .codec import Codec


class BlockSign(reference.BlockSign, Codec):
    __doc__ = reference.BlockSign.__doc__

    def local_scale(self, grad):
        p = tf.reshape(tf.cast(grad, tf.float64), [-1])
        numel = p.shape[0]
        n = self.buckets(numel)
        d = self.bucket_length(numel)
        sums = reduce(tf.abs(p), d, "sum")
        sizes = tf.minimum(numel - d * tf.range(n, dtype=tf.float64), d)
        scale = tf.cast(sums / sizes, tf.float32)
        # Sums propagate NaN and Inf: a non-finite scale marks the whole tensor.
        finite = tf.reduce_all(tf.math.is_finite(scale))
        return tf.where(finite, scale, float("inf"))

    def encode(self, grad, scale, uniforms):
        return tf.cast(tf.where(grad >= 0, 1, -1), tf.int8)

    def decode(self, total, scale, averaged_over):
        return rescale(total, scale, self.bucket_length(total.shape[-1]), averaged_over)
