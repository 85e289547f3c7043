"""DGC in PyTorch ops; the algorithm and its reference are in ``hvd_compress.dgc``."""

import torch

from hvd_compress import dgc as reference

from .codec import Codec
from .scalecom import CyclicLocalTopK


class DGC(reference.DGC, Codec):
    __doc__ = reference.DGC.__doc__

    top_k = CyclicLocalTopK.top_k

    def local_clip(self, grad, world_size):
        if self.clip_norm is None:
            return grad
        norm = torch.linalg.vector_norm(grad, dtype=torch.float64)
        # A tensor factor, not a test of the norm: no wait for a GPU.
        factor = torch.clamp(self.clip_threshold(world_size) / norm, max=1.0)
        return grad.mul_(factor.to(grad.dtype))
