"""PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019): one step of subspace iteration per
training step, with the factors summed by allreduce.

Per compressed tensor, on worker i at step t, with M_i its gradient viewed as an n x m matrix
plus its error-feedback residual e_i, and Q (m x r) the factor kept from the last step:

    Q <- orthogonalize(Q)             # warm start (random draws at the first step)
    P_i = M_i Q                       # n x r
    P = orthogonalize(sum_i P_i)      # allreduce of n r values
    Q_i = M_i^T P                     # m x r
    Q = (1/N) sum_i Q_i               # allreduce of m r values, kept for the next step
    average = P Q^T                   # rank r, the same on every worker
    e_i = M_i - P Q^T                 # what this worker's average did not carry

Every worker sends (n + m) r values instead of n m, in two allreduces that Horovod fuses with
those of the other tensors, so the cost grows like an allreduce's in N. ``orthogonalize`` is
Gram-Schmidt over the r columns (the paper's and torch's ``powerSGD_hook``'s for r <= 2).

Choices made, those of ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (which
the PyTorch port matches to float32 rounding, ``tests/test_powersgd.py``) unless said:

* The matrix of a tensor is (shape[0], rest) in PyTorch's layout (out-features first), which
  is (rest, shape[-1]) in TensorFlow's (out-features last): the same matrix transposed, so
  the factors carry the same bytes.
* A tensor is compressed if (n + m) r min_compression_rate < n m with r = min(n, m, rank):
  vectors (biases, norms) and matrices too narrow for rank r to save go whole by a plain
  allreduce; ``min_compression_rate`` 2 by default, the hook's.
* The first ``start_iter`` steps send every tensor whole (the hook's
  ``start_powerSGD_iter``): early gradients change fast, and warm-started factors need a
  few steps to track them.
* Q starts as uniform draws on [-1, 1) of the shared counter-based stream of the tensor
  (``seeding``, rank 0, step 0): every rank and every port draws the same, where the hook
  draws normals from its own generator. Any full-rank start serves the power iteration.
* A column of zeros (a tensor whose gradient is zero, as for a layer unused this step)
  stays zero where the hook would divide by its zero norm and yield NaN; nonzero columns
  are divided by their norm exactly as the hook does (its ``orthogonalization_epsilon``
  0).
"""

from __future__ import annotations

import numpy as np

from . import seeding
from .codec import Codec
from .codes import FloatCodes
from .validation import check_float, check_int


class PowerSGD(Codec):
    """Rank-r PowerSGD with error feedback and warm-started factors.

    Args:
        rank (int): r, the rank of each tensor's approximation (the paper's r). Default 2:
            rank 1 lost 1.5-2.9 points on the MNIST-1D CNN, rank 2 at most 0.9.
        min_compression_rate (float): compress a tensor only if its factors are this many
            times smaller than it. Default 2 (the hook's).
        start_iter (int): steps at the start that send every tensor whole (the hook's
            ``start_powerSGD_iter``). Default 10.
        min_size (int): tensors with fewer elements are sent whole. Default 0.
        compress_classifier (bool): compress the classifier layer too. Default True.
    """

    name = "powersgd"
    code_space = FloatCodes("float32")
    summable = True  # every worker's factors are in the same basis
    sparse = True  # its exchange runs the error feedback itself
    message = "factors"
    error_feedback_default = True
    # The port's weight layout: PyTorch's out-features first, Keras's last.
    out_features_first = True

    def __init__(
        self,
        rank: int = 2,
        min_compression_rate: float = 2.0,
        start_iter: int = 10,
        *,
        min_size: int | None = None,
        compress_classifier: bool | None = None,
    ) -> None:
        super().__init__(min_size=min_size, compress_classifier=compress_classifier)
        owner = type(self).__name__
        self.rank = check_int(owner, "rank", rank, low=1)
        self.min_compression_rate = check_float(
            owner, "min_compression_rate", min_compression_rate, low=1.0
        )
        self.start_iter = check_int(owner, "start_iter", start_iter, low=0)

    @property
    def uncompressed_steps(self):
        return self.start_iter

    def matrix_shape(self, shape):
        """(n, m): the matrix a tensor of ``shape`` is viewed as, (shape[0], rest) or, in
        the other layout, (rest, shape[-1])."""
        shape = tuple(shape)
        if not shape:
            raise ValueError(f"{type(self).__name__}: a 0-d tensor has no matrix view")
        if self.out_features_first:
            return shape[0], int(np.prod(shape[1:], dtype=np.int64))
        return int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]

    def factor_rank(self, shape):
        """r for a tensor of ``shape``: ``rank``, or less for a thinner matrix."""
        return min(*self.matrix_shape(shape), self.rank)

    def factor_elements(self, shape):
        """Values a worker sends for a compressed tensor of ``shape``: (n + m) r."""
        n, m = self.matrix_shape(shape)
        return (n + m) * self.factor_rank(shape)

    def why_whole(self, shape):
        reason = super().why_whole(shape)
        if reason is not None or not tuple(shape):
            return reason or "a scalar"
        n, m = self.matrix_shape(shape)
        if self.factor_elements(shape) * self.min_compression_rate >= n * m:
            return f"rank {self.factor_rank(shape)} saves < {self.min_compression_rate:g}x"
        return None

    def initial_factor(self, seed, index, shape):
        """Q before the first compressed step of tensor ``index``: m x r uniform draws on
        [-1, 1), the same on every rank."""
        n, m = self.matrix_shape(shape)
        r = self.factor_rank(shape)
        key = seeding.stream_seed(seed, 0, 0, index)
        return (seeding.uniforms(key, m * r) * 2 - 1).reshape(m, r)

    @staticmethod
    def orthogonalize(matrix):
        """Gram-Schmidt over the columns of ``matrix`` (a new array); zero columns stay
        zero."""
        matrix = matrix.copy()
        for i in range(matrix.shape[1]):
            norm = np.linalg.norm(matrix[:, i])
            matrix[:, i] = matrix[:, i] / norm if norm > 0 else 0
            rest = matrix[:, i + 1 :]
            rest -= (matrix[:, i : i + 1] * rest).sum(axis=0) * matrix[:, i : i + 1]
        return matrix

    def average(self, matrices, q):
        """The reference step of one tensor over N workers: ``matrices`` their
        error-compensated M_i, ``q`` the kept factor. Returns (average P Q^T, the new Q)."""
        q = self.orthogonalize(q)
        p = self.orthogonalize(sum(m @ q for m in matrices))
        q = sum(m.T @ p for m in matrices) / len(matrices)
        return p @ q.T, q
