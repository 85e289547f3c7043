"""CLT-k in TensorFlow ops; the algorithm and its reference are in ``hvd_compress.scalecom``."""

import tensorflow as tf

from hvd_compress import scalecom as reference

from .codec import Codec


class CyclicLocalTopK(reference.CyclicLocalTopK, Codec):
    __doc__ = reference.CyclicLocalTopK.__doc__

    def top_k(self, compensated, k):
        magnitude = tf.abs(tf.cast(tf.reshape(compensated, [-1]), tf.float32))
        magnitude = tf.where(tf.math.is_nan(magnitude), float("inf"), magnitude)
        threshold = tf.reduce_min(tf.math.top_k(magnitude, k, sorted=False).values)
        above = magnitude > threshold
        tied = magnitude == threshold
        take = above | (
            tied
            & (tf.cumsum(tf.cast(tied, tf.int32)) <= k - tf.reduce_sum(tf.cast(above, tf.int32)))
        )
        # Exactly k by construction; the static length lets the collectives' shapes be known.
        return tf.reshape(tf.cast(tf.where(take)[:, 0], tf.int32), [k])
