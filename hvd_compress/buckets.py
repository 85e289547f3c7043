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
