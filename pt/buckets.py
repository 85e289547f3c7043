"""PyTorch bucket helpers; mirrors ``hvd_compress.buckets``."""
import torch

from hvd_compress.buckets import count


def expand(scale, numel, bucket_size):
    """Each bucket's scale repeated over its elements (along the last axis)."""
    return torch.repeat_interleave(scale.reshape(scale.shape or (1,)), bucket_size,
                                   dim=-1)[..., :numel]


def reduce(values, bucket_size, reduction):
    """``reduction`` (``"amax"``, ``"sum"``) of each bucket of ``values``, zero-padded."""
    numel = values.shape[-1]
    padded = values.new_zeros(count(numel, bucket_size) * bucket_size)
    padded[:numel] = values
    return getattr(torch, reduction)(padded.reshape(-1, bucket_size), dim=1)





def normalized(grad, scale, bucket_size):
    """r = |g| / scale of each element's bucket, clipped to [0, 1]; see the reference."""
    full = expand(torch.as_tensor(scale, dtype=torch.float32, device=grad.device),
                  grad.shape[-1], bucket_size)
    usable = (full > 0) & torch.isfinite(full)
    r = torch.where(usable, grad.abs().to(torch.float32) / full, torch.zeros_like(full))
    return torch.clamp(r, max=1.0)


def rescale(total, scale, bucket_size, divisor):
    """scale * total / divisor per bucket; NaN wherever the scale is not finite."""
    full = expand(torch.as_tensor(scale, dtype=torch.float32, device=total.device),
                  total.shape[-1], bucket_size)
    value = full * total.to(torch.float32) / float(divisor)
    return torch.where(torch.isfinite(full), value, torch.full_like(value, float("nan")))
