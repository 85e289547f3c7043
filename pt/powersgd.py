"""PowerSGD in PyTorch ops; the algorithm and its reference are in ``hvd_compress.powersgd``."""

import torch

from hvd_compress import powersgd as reference

from .codec import Codec


class PowerSGD(reference.PowerSGD, Codec):
    __doc__ = reference.PowerSGD.__doc__

    @staticmethod
    def orthogonalize(matrix):
        matrix = matrix.clone()
        for i in range(matrix.shape[1]):
            column = matrix[:, i : i + 1]
            norm = torch.norm(column, dim=0, keepdim=True)
            # torch.where, not a test of the norm: no wait for a GPU.
            column.copy_(torch.where(norm > 0, column / norm, 0.0))
            rest = matrix[:, i + 1 :]
            rest -= torch.sum(column * rest, dim=0, keepdim=True) * column
        return matrix
