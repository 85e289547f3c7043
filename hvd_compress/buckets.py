"""Buckets: a flattened tensor cut into runs of ``bucket_size`` elements, one scale each."""

import numpy as np


def count(numel, bucket_size):
    return -(-numel // bucket_size)


def expand(scale, numel, bucket_size):
    """Each bucket's scale repeated over its elements (along the last axis)."""
    return np.repeat(scale, bucket_size, axis=-1)[..., :numel]


def reduce(values, bucket_size, reduction):
    """``reduction`` (``np.max``, ...) of each bucket of ``values``, padded with zeros."""
    numel = values.shape[-1]
    padded = np.zeros(count(numel, bucket_size) * bucket_size, values.dtype)
    padded[:numel] = values
    return reduction(padded.reshape(-1, bucket_size), axis=1)


def normalized(grad, scale, bucket_size):
    """r = |g| / scale of each element's bucket, clipped to [0, 1]. A zero scale (all-zero
    bucket) or an infinite one (non-finite gradient) gives r = 0."""
    full = expand(np.asarray(scale, np.float32), grad.shape[-1], bucket_size)
    usable = (full > 0) & np.isfinite(full)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(usable, np.abs(grad.astype(np.float32)) / full, np.float32(0))
    return np.minimum(r, np.float32(1))


def rescale(total, scale, bucket_size, divisor):
    """scale * total / divisor per bucket, as float32; NaN wherever the scale is not finite."""
    full = expand(np.asarray(scale, np.float32), total.shape[-1], bucket_size)
    value = full * total.astype(np.float32) / np.float32(divisor)
    return np.where(np.isfinite(full), value, np.float32(np.nan))
