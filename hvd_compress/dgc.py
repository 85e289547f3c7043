"""Deep Gradient Compression (Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression:
Reducing the Communication Bandwidth for Distributed Training", ICLR 2018): top-k
sparsification with the corrections that keep it as accurate as dense SGD.

Per tensor, on worker i at step t, with mu the optimizer's momentum:

    g <- g min(1, c / (sqrt(N) ||g||))      # local gradient clipping (if clip_norm c)
    u <- mu u + g                           # momentum correction: the worker's velocity
    v <- v + u                              # accumulated, what was not sent yet
    I = indices of the k largest |v|,  k = ceil(density_t n)
    send (I, v_I);  v_I <- 0;  u_I <- 0     # momentum factor masking
    average = (1/N) sum_i scatter(I_i, v_i,I)   # every worker's own indices, allgathered

The velocity u is the wrapper's worker momentum (``worker_momentum``, on by default for
this codec with an SGD that has momentum: the base optimizer then steps as plain SGD, so no
momentum is applied twice; under a heavy-ball SGD the wrappers accumulate g + mu u,
Nesterov's form, which trained closer to uncompressed SGD: ``hvd_compress.remedies``),
v is the worker's error-feedback residual, and the exchange
masks both at the indices it sends. Without momentum (another optimizer, or
``worker_momentum=False``) this is top-k with error feedback; under Adam and AdamW the
wrappers send Adam's momentum through it instead of the gradient (compressed Adam,
``hvd_compress.remedies``).

density_t is ``density`` after the warm-up. During the first ``warmup_steps`` it falls
exponentially in ``WARMUP_STAGES`` equal stages, 25%, 6.25%, 1.5625%, 0.390625% (the
paper's 75%, 93.75%, 98.4375%, 99.6% sparsity over its first four epochs), never below
``density``.

Choices made (the paper's unless said):

* Clipping is per tensor, where the paper clips the worker's whole gradient: each tensor's
  gradient is exchanged as soon as autograd produces it, before the others exist.
* Ties at the k-th magnitude go to the lower indices and NaN counts as the largest, as in
  CLT-k (``scalecom``): exactly k elements, the same in every port.
* The indices travel as int32, the values as float32, on two allgathers of k each (k is the
  same on every worker, so no lengths travel); the sum is taken in rank order, so every
  rank holds the same bits.
* Tensors under 1024 elements (biases, norms) are sent whole by default.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from .codec import Codec
from .codes import FloatCodes
from .scalecom import CyclicLocalTopK
from .validation import check_float, check_int

# The warm-up's density falls by this factor per stage, over this many stages.
WARMUP_FACTOR, WARMUP_STAGES = 0.25, 4


class DGC(Codec):
    """Top-k of the accumulated velocity, with DGC's corrections.

    Args:
        density (float): k / n after the warm-up, in (0, 1]. Default 0.001, the
            paper's. Higher densities lose accuracy: each send resets a coordinate's
            momentum (``docs/algorithms.md``).
        warmup_steps (int): steps of the exponential density warm-up (0: none). Default 0.
        clip_norm (float or None): c of the local gradient clipping, the threshold of a
            whole gradient's norm (each worker clips at c / sqrt(N)). None: no clipping.
        min_size (int): tensors with fewer elements are sent whole. Default 1024.
        compress_classifier (bool): compress the classifier layer too. Default True.
        ratio (float): the former name of ``density``, which it still sets with a
            ``DeprecationWarning``.
    """

    name = "dgc"
    code_space = FloatCodes("float32")
    sparse = True
    message = "own_indices"
    error_feedback_default = True
    worker_momentum_default = True
    adam_remedy = True  # hvd_compress.remedies
    nesterov_remedy = True
    default_min_size = 1024
    renamed = {"ratio": "density"}

    def __init__(
        self,
        density: float = 0.001,
        warmup_steps: int = 0,
        clip_norm: float | None = None,
        *,
        min_size: int | None = None,
        compress_classifier: bool | None = None,
        ratio: float | None = None,
    ) -> None:
        super().__init__(min_size=min_size, compress_classifier=compress_classifier)
        owner = type(self).__name__
        if ratio is not None:
            warnings.warn(
                f"{owner}: ratio= is deprecated, pass density= (k / n, the same value)",
                DeprecationWarning,
                stacklevel=2,
            )
            density = ratio
        self.density = check_float(owner, "density", density, low=0.0, high=1.0)
        if self.density == 0:
            raise ValueError(f"{owner}: density must be in (0, 1], got 0 (nothing would be sent)")
        self.warmup_steps = check_int(owner, "warmup_steps", warmup_steps, low=0)
        self.clip_norm = (
            None if clip_norm is None else check_float(owner, "clip_norm", clip_norm, low=0.0)
        )
        if self.clip_norm == 0:
            raise ValueError(f"{owner}: clip_norm must be > 0 or None, got 0")

    def density_at(self, step):
        """k / n at ``step`` (a Python int: the step counter every rank shares)."""
        if step < self.warmup_steps:
            stage = step * WARMUP_STAGES // self.warmup_steps
            return max(self.density, WARMUP_FACTOR ** (stage + 1))
        return self.density

    def k(self, numel, step):
        """Elements sent of a tensor of ``numel`` at ``step``: at least one."""
        return max(1, min(numel, math.ceil(self.density_at(step) * numel)))

    top_k = CyclicLocalTopK.top_k

    def clip_threshold(self, world_size):
        """Each worker's threshold of its gradient's norm: c / sqrt(N)."""
        return self.clip_norm / math.sqrt(world_size)

    def local_clip(self, grad, world_size):
        """``grad`` scaled to norm at most c / sqrt(N) (itself without clipping)."""
        if self.clip_norm is None:
            return grad
        norm = np.linalg.norm(grad.astype(np.float64))
        return grad * np.float32(min(1.0, self.clip_threshold(world_size) / norm)) if norm else grad
