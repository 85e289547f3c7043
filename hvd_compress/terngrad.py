"""TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
Deep Learning", NIPS 2017), layer-wise, with scaler sharing.

Per tensor g on worker i:

    s_i = min(c * sigma_i, max|g|)    sigma_i: the (population) standard deviation of g;
                                      c = 0 gives s_i = max|g| (no clipping)
    s   = max_i s_i                   "scaler sharing": one Max-allreduce
    b_k ~ Bernoulli(min(|g_k| / s, 1))
    q_k = sign(g_k) * b_k             in {-1, 0, 1}, 2 bits on the wire
    g_hat = s * sum_i q_i / N         identical on every worker

This is the uniform quantizer of ``quantizer.py`` with one level and one bucket per tensor.
E[s * q_k] = clip(g_k, -s, s): unbiased with respect to the clipped gradient. Elements with
|g_k| >= s are sent as sign(g_k) * s with certainty, which is the paper's gradient clipping;
the reference code computes s = c * sigma and never clips explicitly. Taking the max norm of
the clipped gradient, min(c * sigma, max|g|), is the paper's definition of the scaler and never
larger than c * sigma, so it has no more variance.

A non-finite gradient gives s_i = +inf, which survives the Max on every worker; every worker
then decodes the whole tensor as NaN, so a ``GradScaler`` (or any finiteness check) skips
the step on all ranks alike instead of training on finite codes made from garbage.
"""

from __future__ import annotations

import numpy as np

from .quantizer import UniformQuantizer
from .validation import check_float


def shifted_variance(total: float, squares: float, count: int) -> float:
    """The variance of ``count`` elements g from the float64 sums of d and d^2 over them,
    d = g - g[0]: one pass over g, where subtracting the mean first takes two. Shifted by an
    element, the sums do not cancel each other when the mean dwarfs the spread (a constant
    g gives exactly 0); the clamp at 0 takes off what rounding leaves below it."""
    return max(squares - total * total / count, 0.0) / count


class TernGrad(UniformQuantizer):
    """Stochastic ternary gradients with a shared per-tensor scaler.

    Args:
        clip (float): c, the clipping factor in units of the tensor's standard deviation
            (the scaler is min(c * sigma, max|g|)). The paper uses c = 2.5 for every network
            and optimizer (cross-validated once on CIFAR-10); 0 disables clipping, which cost
            2.7 points of top-1 on AlexNet. Default 2.5.
        min_size (int): tensors with fewer elements are sent as float32 (``size_to_binarize``
            of the reference code; its ImageNet scripts use 9217, which keeps every bias
            whole). Default 9217.
        compress_classifier (bool): ternarize the final classifier layer too
            (``quantize_logits``). Default False, as in the reference code: the classifier's
            gradient is skewed and small.
    """

    name = "terngrad"
    levels = 1
    default_min_size = 9217
    compress_classifier_default = False

    def __init__(
        self,
        clip: float = 2.5,
        *,
        min_size: int | None = None,
        compress_classifier: bool | None = None,
    ) -> None:
        super().__init__(min_size=min_size, compress_classifier=compress_classifier)
        self.clip = check_float("TernGrad", "clip (c)", clip, low=0.0)

    def shares_scale(self, exchange):
        return True

    def local_scale(self, grad):
        g = grad.astype(np.float32).ravel()
        if not np.isfinite(g).all():
            return np.full(1, np.inf, np.float32)
        amax = np.abs(g).max(initial=np.float32(0))
        if self.clip == 0 or g.size == 0:
            return np.full(1, amax, np.float32)
        d = g.astype(np.float64) - np.float64(g[0])
        sigma = np.sqrt(shifted_variance(d.sum(), d @ d, g.size))
        return np.full(1, min(np.float32(self.clip) * np.float32(sigma), amax), np.float32)

    def probabilities(self, grad, scale):
        """P(b_k = 1) = min(|g_k| / s, 1); zero where s is zero."""
        return self.rounding(grad, scale)[2]
