"""TernGrad in PyTorch ops; the algorithm and its reference are in ``hvd_compress.terngrad``."""
import torch

from hvd_compress import terngrad as reference

from .codec import Codec


class TernGrad(reference.TernGrad, Codec):
    __doc__ = reference.TernGrad.__doc__

    def local_scale(self, grad):
        g = grad.detach().reshape(-1).to(torch.float32)
        if g.numel() == 0:
            return g.new_zeros(1)
        amax = g.abs().max()
        if self.clip == 0:
            scale = amax
        else:
            var, _ = torch.var_mean(g, correction=0)
            scale = torch.minimum(self.clip * var.sqrt(), amax)
        # Kept on the device (no .item()): +inf flags a non-finite gradient to the Max.
        finite = torch.isfinite(g).all()
        return torch.where(finite, scale, torch.full_like(scale, float("inf"))).reshape(1)

    def probabilities(self, grad, scale):
        s = torch.as_tensor(scale, dtype=torch.float32, device=grad.device).reshape(())
        p = torch.clamp(grad.abs().to(torch.float32) / s, max=1.0)
        return torch.where(s > 0, p, torch.zeros_like(p))

    def encode(self, grad, scale, uniforms):
        fire = uniforms < self.probabilities(grad, scale)
        return (torch.sign(grad) * fire).to(torch.int8)

    def decode(self, total, scale, count):
        s = torch.as_tensor(scale, dtype=torch.float32, device=total.device).reshape(())
        value = s * total.to(torch.float32) / count
        return torch.where(torch.isfinite(s), value, torch.full_like(value, float("nan")))
