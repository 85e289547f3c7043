"""CLT-k in PyTorch ops; the algorithm and its reference are in ``hvd_compress.scalecom``."""

import torch

from hvd_compress import scalecom as reference

from .codec import Codec


class CyclicLocalTopK(reference.CyclicLocalTopK, Codec):
    __doc__ = reference.CyclicLocalTopK.__doc__

    def top_k(self, compensated, k):
        magnitude = compensated.reshape(-1).to(torch.float32).abs()
        magnitude = torch.where(torch.isnan(magnitude), torch.inf, magnitude)
        threshold = torch.topk(magnitude, k, sorted=False).values.min()
        above = magnitude > threshold
        tied = magnitude == threshold
        take = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
        # Exactly k taken: the size is known, so finding them needs no read of the device.
        return torch.nonzero_static(take, size=k).reshape(-1).to(torch.int32)
