"""DGC in TensorFlow ops; the algorithm and its reference are in ``hvd_compress.dgc``."""

import tensorflow as tf

from hvd_compress import dgc as reference

from .codec import Codec
from .scalecom import CyclicLocalTopK


class DGC(reference.DGC, Codec):
    __doc__ = reference.DGC.__doc__

    top_k = CyclicLocalTopK.top_k

    def k(self, numel, step):
        """k at ``step``, which may be the pipeline's step variable: an int32 tensor then,
        computed as the reference computes it in float64."""
        if isinstance(step, int):
            return super().k(numel, step)
        step = tf.cast(step, tf.int64)
        density = tf.constant(self.density, tf.float64)
        if self.warmup_steps:
            stage = step * reference.WARMUP_STAGES // self.warmup_steps
            warm = tf.maximum(
                density,
                tf.pow(
                    tf.constant(reference.WARMUP_FACTOR, tf.float64), tf.cast(stage + 1, tf.float64)
                ),
            )
            density = tf.where(step < self.warmup_steps, warm, density)
        k = tf.clip_by_value(tf.math.ceil(density * numel), 1.0, float(numel))
        return tf.cast(k, tf.int32)

    def local_clip(self, grad, world_size):
        if self.clip_norm is None:
            return grad
        norm = tf.norm(tf.cast(grad, tf.float64))
        factor = tf.minimum(self.clip_threshold(world_size) / norm, 1.0)
        return grad * tf.cast(factor, grad.dtype)
