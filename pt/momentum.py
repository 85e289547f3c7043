"""dist-EF-blockSGDM's worker-side momentum (Zheng et al., NeurIPS 2019, Algorithm 2 and the
authors' code), as an optimizer mode of ``DistributedOptimizer`` over ``torch.optim.SGD``.

Per parameter, with mu = the group's momentum and eta_t its learning rate:

    before the exchange:  m = mu m + g;  u = g + mu m  (Nesterov; u = m without it)
                          the residuals enter as u + (eta_{t-1} / eta_t) e
    after the exchange:   Delta~ = the decoded server message (gradient units)
                          w = mu w + wd x;  x -= eta_t (Delta~ + wd x + mu w)

Weight decay stays out of compression, with its own momentum buffer w, and the base SGD step
runs with momentum and weight decay switched off, so nothing is applied twice. Learning-rate
changes from any scheduler are seen through the parameter groups.
"""

import contextlib
import dataclasses

import torch

from . import fused
from .memory import choose


class WorkerMomentum:
    @dataclasses.dataclass
    class Deferred:
        """One gradient's momentum step, left to the pipeline's fused compensation
        (``fused.compensated_scale``), which writes the new m into ``out``."""

        buffer: torch.Tensor  # m
        mu: float
        nesterov: bool
        out: torch.Tensor

    def __init__(self, optimizer, pipeline):
        self.optimizer = optimizer
        self.pipeline = pipeline
        # Group positions, not the group dicts: load_state_dict replaces the dicts, and the
        # learning rate must be read from the live ones that schedulers set.
        self.group_index = {
            p: i for i, group in enumerate(optimizer.param_groups) for p in group["params"]
        }
        self.momentum = {}  # name -> m
        self.decay = {}  # name -> w, the weight-decay momentum
        self.learning_rate = {}  # name -> eta of the last exchange
        # name -> (m, eta) of the step in flight, kept by ``commit`` only if the step's
        # gradients are finite everywhere (the pipeline decides, like its residuals).
        self.proposed = {}
        pipeline.state.momentum = self

    def mask(self, name, indices):
        """Forgets the proposed momentum of tensor ``name`` at ``indices``, which its
        exchange sent (DGC's momentum factor masking)."""
        buffer, _ = self.proposed[name]
        if buffer is not None:
            # ``indices`` count the elements in the gradient's logical order; m keeps the
            # gradient's layout (channels_last, say), which a flat view cannot address.
            buffer[torch.unravel_index(indices, buffer.shape)] = 0

    @staticmethod
    def check(optimizer):
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(
                f"worker_momentum needs a torch.optim.SGD, got {type(optimizer).__name__}"
            )
        for group in optimizer.param_groups:
            if group.get("dampening", 0) != 0:
                raise ValueError("worker_momentum needs SGD with dampening=0")

    def _name(self, param):
        return self.pipeline.plans[param].name

    def before_exchange(self, param, defer=False):
        """Turns ``param.grad`` into the momentum direction u; returns (eta_{t-1} / eta_t,
        None). With ``defer`` (the pipeline compensates ``param`` in a fused kernel), a
        step with a momentum buffer leaves ``param.grad`` as it is and returns
        (eta_{t-1} / eta_t, ``Deferred``) for the pipeline to apply."""
        group = self.optimizer.param_groups[self.group_index[param]]
        name, mu, lr = self._name(param), group["momentum"], group["lr"]
        grad = param.grad
        buffer = deferred = None
        if mu > 0:
            buffer = self.momentum.get(name)
            # New tensors for m: the old one stays until ``commit``.
            if buffer is not None and defer:
                deferred = self.Deferred(buffer, mu, group["nesterov"], torch.empty_like(grad))
                buffer = deferred.out
            elif buffer is not None and grad.is_contiguous() and self.pipeline.on_kernels(grad):
                buffer = fused.momentum(grad, buffer, mu, group["nesterov"])
            else:
                buffer = grad.clone() if buffer is None else torch.add(grad, buffer, alpha=mu)
                if group["nesterov"]:
                    grad.add_(buffer, alpha=mu)
                else:
                    grad.copy_(buffer)
        self.proposed[name] = (buffer, lr)
        return self.learning_rate.get(name, lr) / lr, deferred

    def commit(self, keep):
        """Keeps (``keep``: a bool, or a boolean 0-d tensor, selected by and not read: the
        learning rates then become 0-d tensors on its device) or drops the step's m and eta."""
        if isinstance(keep, torch.Tensor):
            for name, (buffer, lr) in self.proposed.items():
                if buffer is not None:
                    self.momentum[name] = choose(keep, buffer, self.momentum.get(name))
                previous = self.learning_rate.get(name)
                if previous is None:  # nothing kept yet, so no residual it could rescale
                    self.learning_rate[name] = lr
                else:
                    if not isinstance(previous, torch.Tensor):  # filled, not copied: no wait
                        previous = torch.full((), previous, dtype=torch.float64, device=keep.device)
                    self.learning_rate[name] = torch.where(keep, lr, previous)
        elif keep:
            for name, (buffer, lr) in self.proposed.items():
                if buffer is not None:
                    self.momentum[name] = buffer
                self.learning_rate[name] = lr
        self.proposed = {}

    @contextlib.contextmanager
    def applied_by_worker(self):
        """Adds weight decay (with its own momentum) to the exchanged direction, then lets
        the base SGD step run as plain SGD."""
        for group in self.optimizer.param_groups:
            mu, decay = group["momentum"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None or decay == 0:
                    continue
                name = self._name(param)
                step = param.detach() * decay
                buffer = self.decay.get(name)
                buffer = step.clone() if buffer is None else buffer.mul_(mu).add_(step)
                self.decay[name] = buffer
                param.grad.add_(step).add_(buffer, alpha=mu)
        with self.plain_sgd():
            yield

    @contextlib.contextmanager
    def plain_sgd(self):
        """Switches the base SGD's momentum, weight decay and Nesterov off in every group,
        and back on at the end: this mode applies them itself, so the base step must not,
        and plain SGD keeps no state (no ``momentum_buffer``)."""
        saved = []
        for group in self.optimizer.param_groups:
            saved.append((group, group["momentum"], group["weight_decay"], group["nesterov"]))
            group.update(momentum=0, weight_decay=0, nesterov=False)
        try:
            yield
        finally:
            for group, mu, decay, nesterov in saved:
                group.update(momentum=mu, weight_decay=decay, nesterov=nesterov)

    def state_dict(self):
        return {
            "momentum": {k: v.clone() for k, v in self.momentum.items()},
            "decay": {k: v.clone() for k, v in self.decay.items()},
            "learning_rate": {k: float(v) for k, v in self.learning_rate.items()},
        }

    def load_state_dict(self, state, placed):
        """Restores ``state`` through ``placed``, which copies its tensors onto their devices."""
        self.momentum = placed(state["momentum"])
        self.decay = placed(state["decay"])
        self.learning_rate = dict(state["learning_rate"])
