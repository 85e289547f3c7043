"""TensorFlow bucket helpers; mirrors ``hvd_compress.buckets``."""

import tensorflow as tf

from hvd_compress.buckets import count

from .codec import divide


def expand(scale, numel, bucket_size):
    """Each bucket's scale repeated over its elements (along the last axis)."""
    return tf.repeat(scale, bucket_size, axis=-1)[..., :numel]


def reduce(values, bucket_size, reduction):
    """``reduction`` (``"max"``, ``"sum"``) of each bucket of ``values``, zero-padded."""
    numel = values.shape[-1]
    padded = tf.pad(values, [[0, count(numel, bucket_size) * bucket_size - numel]])
    return getattr(tf.math, f"reduce_{reduction}")(tf.reshape(padded, [-1, bucket_size]), axis=1)


def normalized(grad, scale, bucket_size):
    """r = |g| / scale of each element's bucket, clipped to [0, 1]; see the reference."""
    full = expand(tf.cast(scale, tf.float32), grad.shape[-1], bucket_size)
    usable = (full > 0) & tf.math.is_finite(full)
    r = tf.where(usable, tf.abs(tf.cast(grad, tf.float32)) / full, tf.zeros_like(full))
    return tf.minimum(r, 1.0)


def rescale(total, scale, bucket_size, divisor):
    """scale * total / divisor per bucket; NaN wherever the scale is not finite."""
    full = expand(tf.cast(scale, tf.float32), total.shape[-1], bucket_size)
    value = divide(full * tf.cast(total, tf.float32), divisor)
    return tf.where(tf.math.is_finite(full), value, tf.fill(tf.shape(value), float("nan")))
