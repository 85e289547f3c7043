"""PyTorch bucket helpers; mirrors ``hvd_compress.buckets``."""
import torch

from hvd_compress.buckets import count


def expand(scale, numel, bucket_size):
    """Each bucket's scale repeated over its elements (along the last axis)."""
    return torch.repeat_interleave(scale, bucket_size, dim=-1)[..., :numel]


def reduce(values, bucket_size, reduction):
    """``reduction`` (``"amax"``, ``"sum"``) of each bucket of ``values``, zero-padded."""
    numel = values.shape[-1]
    padded = values.new_zeros(count(numel, bucket_size) * bucket_size)
    padded[:numel] = values
    return getattr(torch, reduction)(padded.reshape(-1, bucket_size), dim=1)


__all__ = ["count", "expand", "reduce"]
