"""dist-EF-blockSGDM's worker-side momentum (Zheng et al., NeurIPS 2019, Algorithm 2 and the
authors' code), as an optimizer mode of ``DistributedOptimizer`` over ``torch.optim.SGD``.

Per parameter, with mu = the group's momentum and eta_t its learning rate:

    before the exchange:  m = mu m + g;  u = g + mu m  (Nesterov's form, the groups' or
                          the mode's; u = m in heavy-ball's)
                          the residuals enter as u + (eta_{t-1} / eta_t) e
    after the exchange:   Delta~ = the decoded server message (gradient units)
                          w = mu w + wd x;  x -= eta_t (Delta~ + wd x + mu w)

Weight decay stays out of compression, with its own momentum buffer w, and the base SGD step
runs with momentum and weight decay switched off, so nothing is applied twice. Learning-rate
changes from any scheduler are seen through the parameter groups.

A tensor sent whole (a bias, a norm's scale) has no residual, and the average of the
workers' momenta is the momentum of the average: its m is kept of the averaged gradient,
after the exchange, for all of them at once (``torch._foreach_*``), as SGD keeps it; the
same on every rank. On a GPU that is a handful of launches a step instead of a few per
tensor, as is weight decay's step.
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

    def __init__(self, optimizer, pipeline, nesterov=False):
        self.optimizer = optimizer
        self.pipeline = pipeline
        # Nesterov's form in every group, whatever the groups say (worker_momentum="nesterov")
        self.nesterov = nesterov
        # Group positions, not the group dicts: load_state_dict replaces the dicts, and the
        # learning rate must be read from the live ones that schedulers set.
        self.group_index = {
            p: i for i, group in enumerate(optimizer.param_groups) for p in group["params"]
        }
        # name -> m: a parameter's, or a gradient bucket's for its members while it
        # carries them (``pt/bucketing.py``)
        self.momentum = {}
        self.decay = {}  # name -> w, the weight-decay momentum
        self.learning_rate = {}  # group index -> eta of the last exchange
        # name -> m, and group index -> eta, of the step in flight, kept by ``commit`` only
        # if the step's gradients are finite everywhere (the pipeline decides, like its
        # residuals).
        self.proposed = {}
        self.proposed_rates = {}
        # name -> m of the tensors sent whole, of the last exchange (``after_exchange``)
        self.proposed_whole = {}
        self._ratios = {}  # group index -> eta_{t-1} / eta_t of the step in flight
        pipeline.state.momentum = self

    def mask(self, name, indices):
        """Forgets the proposed momentum of tensor ``name`` at ``indices``, which its
        exchange sent (DGC's momentum factor masking)."""
        buffer = self.proposed.get(name)
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

    def _nesterov(self, group):
        return self.nesterov or group["nesterov"]

    def _name(self, param):
        return self.pipeline.plans[param].name

    def _sent_whole(self, param):
        """Whether ``param``'s gradient is always sent whole: its momentum is taken after
        the exchange (``applied_by_worker``)."""
        return self.pipeline.plans[param].reason != "compressed"

    def _lr_ratio(self, index, lr):
        """eta_{t-1} / eta_t of group ``index``, whose learning rate is ``lr``: once per
        group and step (a 0-d tensor once the rates are kept on the device)."""
        if index not in self._ratios:
            self.proposed_rates[index] = lr
            previous = self.learning_rate.get(index, lr)
            if isinstance(previous, torch.Tensor) and fused.host_reads(previous):
                previous = float(previous)  # the CPU kernels take numbers
            self._ratios[index] = previous / lr
        return self._ratios[index]

    def before_exchange(self, param, defer=False):
        """Turns ``param.grad`` into the momentum direction u; returns (eta_{t-1} / eta_t,
        None). With ``defer`` (the pipeline compensates ``param`` in a fused kernel), a
        step with a momentum buffer leaves ``param.grad`` as it is and returns
        (eta_{t-1} / eta_t, ``Deferred``) for the pipeline to apply. A gradient that
        travels in a gradient bucket stays as it is too: its bucket takes the step
        (``accelerate``); as does one sent whole, whose step comes after the exchange
        (``applied_by_worker``)."""
        index = self.group_index[param]
        group = self.optimizer.param_groups[index]
        lr_ratio = self._lr_ratio(index, group["lr"])
        name, mu = self._name(param), group["momentum"]
        if mu == 0 or self._sent_whole(param) or self.pipeline.buckets.carries(name):
            return lr_ratio, None
        grad = param.grad
        deferred = None
        buffer = self.momentum.get(name)
        # New tensors for m: the old one stays until ``commit``.
        if buffer is not None and defer:
            deferred = self.Deferred(buffer, mu, self._nesterov(group), torch.empty_like(grad))
            buffer = deferred.out
        elif buffer is not None and grad.is_contiguous() and self.pipeline.on_kernels(grad):
            buffer = fused.momentum(grad, buffer, mu, self._nesterov(group))
        else:
            buffer = self._step(grad, buffer, mu, self._nesterov(group))
        self.proposed[name] = buffer
        return lr_ratio, deferred

    @staticmethod
    def _step(grad, buffer, mu, nesterov):
        """m = mu m + g, and ``grad`` becomes u = g + mu m (or m); returns the new m."""
        buffer = grad.clone() if buffer is None else torch.add(grad, buffer, alpha=mu)
        if nesterov:
            grad.add_(buffer, alpha=mu)
        else:
            grad.copy_(buffer)
        return buffer

    def accelerate(self, bucket, params, vector, members):
        """``before_exchange`` of a full gradient bucket's members (``params``), whose
        gradients ``vector`` holds (``members``: their views of it): one step of the whole
        vector where its members' groups share their momentum, else one per member."""
        groups = [self.optimizer.param_groups[self.group_index[p]] for p in params]
        settings = {(g["momentum"], self._nesterov(g)) for g in groups}
        if len(settings) == 1:
            mu, nesterov = settings.pop()
            if mu > 0:
                self.proposed[bucket.name] = self._step(
                    vector, self.momentum.get(bucket.name), mu, nesterov
                )
            return
        # Members of groups with different momenta: each its own step, on its view, and
        # the bucket's m made of theirs.
        old = self.momentum.get(bucket.name)
        buffer = torch.zeros_like(vector)
        for member, group, view in zip(bucket.members, groups, members):
            if group["momentum"] > 0:
                part = None if old is None else old[member.offset : member.stop]
                buffer[member.offset : member.stop] = self._step(
                    view, part, group["momentum"], self._nesterov(group)
                )
        self.proposed[bucket.name] = buffer

    def commit(self, keep):
        """Keeps (``keep``: a bool, or a boolean 0-d tensor, selected by and not read: the
        learning rates then become 0-d tensors on its device) or drops the step's m and eta."""
        if isinstance(keep, torch.Tensor):
            for name, buffer in self.proposed.items():
                self.momentum[name] = choose(keep, buffer, self.momentum.get(name))
            for index, lr in self.proposed_rates.items():
                previous = self.learning_rate.get(index)
                if previous is None:  # nothing kept yet, so no residual it could rescale
                    self.learning_rate[index] = lr
                elif previous is not lr:
                    if not isinstance(previous, torch.Tensor):  # filled, not copied: no wait
                        previous = torch.full((), previous, dtype=torch.float64, device=keep.device)
                    self.learning_rate[index] = torch.where(keep, lr, previous)
        elif keep:
            self.momentum.update(self.proposed)
            self.learning_rate.update(self.proposed_rates)
        self.proposed, self.proposed_rates, self._ratios = {}, {}, {}

    def after_exchange(self):
        """The momentum step of the tensors sent whole, on their averaged gradients, which
        become u; their new m is kept if the optimizer steps (``applied_by_worker``), so a
        step that ``GradScaler`` skips leaves it."""
        self.proposed_whole = {}
        for group in self.optimizer.param_groups:
            mu = group["momentum"]
            sent_whole = [p for p in group["params"] if p.grad is not None and self._sent_whole(p)]
            if mu == 0 or not sent_whole:
                continue
            names = [self._name(p) for p in sent_whole]
            grads = [p.grad for p in sent_whole]
            buffers = [self.momentum.get(n) for n in names]
            buffers = [torch.zeros_like(g) if m is None else m for g, m in zip(grads, buffers)]
            buffers = torch._foreach_add(grads, buffers, alpha=mu)
            if self._nesterov(group):
                torch._foreach_add_(grads, buffers, alpha=mu)
            else:
                torch._foreach_copy_(grads, buffers)
            self.proposed_whole.update(zip(names, buffers))

    @contextlib.contextmanager
    def applied_by_worker(self):
        """Keeps the momentum of the tensors sent whole, adds weight decay (with its own
        momentum) to the exchanged direction, then lets the base SGD step run as plain
        SGD."""
        self.momentum.update(self.proposed_whole)
        self.proposed_whole = {}
        for group in self.optimizer.param_groups:
            mu, decay = group["momentum"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            if decay != 0 and params:
                names = [self._name(p) for p in params]
                steps = torch._foreach_mul([p.detach() for p in params], decay)
                buffers = [self.decay.get(n) for n in names]
                if any(w is None for w in buffers):  # a first step: w = wd x
                    buffers = [
                        s.clone() if w is None else w.mul_(mu).add_(s)
                        for s, w in zip(steps, buffers)
                    ]
                else:
                    torch._foreach_mul_(buffers, mu)
                    torch._foreach_add_(buffers, steps)
                self.decay.update(zip(names, buffers))
                grads = [p.grad for p in params]
                torch._foreach_add_(grads, steps)
                torch._foreach_add_(grads, buffers, alpha=mu)
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

    # Where each parameter's m and w appear in the optimizer's ``state_dict()["state"]``:
    # SGD's own name for m, and one for w; and its group's eta of the last exchange, which
    # rescales the residuals (a replicated server's too, which must be alike everywhere).
    TORCH_STATE = {"momentum": "momentum_buffer", "decay": "weight_decay_buffer"}
    LEARNING_RATE = "exchanged_lr"

    def _buffers(self, role):
        return self.momentum if role == "momentum" else self.decay

    def expose(self, torch_state: dict, ours: dict) -> None:
        """Moves every parameter's m and w from the pipeline's part of a ``state_dict()``
        (``ours``) into torch's ``state`` of it (``torch_state``, by parameter index), as
        the tensors this mode steps (zeros where no step has made one yet, which the next
        step takes as none), with their group's eta of the last exchange. Every rank's
        ``state`` then has the same entries whatever its options, and
        ``hvd.broadcast_optimizer_state``, which broadcasts each tensor of it in place and
        the groups' options after them (but nothing at all for an empty ``state``), brings
        rank 0's to every rank."""
        self.pipeline.buckets.release_momentum()
        index = 0
        for group_index, group in enumerate(self.optimizer.param_groups):
            eta = None
            for param in group["params"]:
                if param.requires_grad:
                    if eta is None:
                        eta = self._rate_tensor(group_index, group["lr"], param.device)
                    entry = torch_state.setdefault(index, {})
                    entry[self.LEARNING_RATE] = eta
                    name = self._name(param)
                    for role, key in self.TORCH_STATE.items():
                        buffers = self._buffers(role)
                        if name not in buffers:
                            buffers[name] = torch.zeros_like(param)
                        entry[key] = buffers[name]
                index += 1
        for role in self.TORCH_STATE:
            ours["momentum"].pop(role)

    def _rate_tensor(self, index, lr, device):
        """Group ``index``'s eta of the last exchange as a float64 0-d tensor on ``device``,
        kept as such so that a broadcast into it is this mode's (``lr``, the group's
        rate, where no exchange has kept one: the same ratio of 1)."""
        eta = self.learning_rate.get(index, lr)
        if not isinstance(eta, torch.Tensor):
            eta = torch.tensor(eta, dtype=torch.float64, device=device)
        self.learning_rate[index] = eta
        return eta

    def extract(self, state_dict: dict) -> tuple[dict, dict]:
        """(``state_dict`` without ``expose``'s entries, those entries by parameter index),
        for ``adopt``: torch's ``load_state_dict`` would convert eta to the parameters'
        dtype."""
        keys = (*self.TORCH_STATE.values(), self.LEARNING_RATE)
        rest, ours = {}, {}
        for index, entry in state_dict["state"].items():
            rest[index] = {k: v for k, v in entry.items() if k not in keys}
            ours[index] = {k: v for k, v in entry.items() if k in keys}
        return {**state_dict, "state": rest}, ours

    def adopt(self, entries: dict) -> None:
        """Takes the m, w and eta of a loaded ``state_dict()`` (``extract``'s entries, by
        parameter index: ``expose``'s, or a stock SGD's ``momentum_buffer``) as this
        mode's, each on its parameter's device."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, entry in entries.items():
            param = params[index]
            for role, key in self.TORCH_STATE.items():
                if key in entry:
                    buffer = entry[key].to(param.device, param.dtype, copy=True)
                    self._buffers(role)[self._name(param)] = buffer
            if self.LEARNING_RATE in entry:
                eta = entry[self.LEARNING_RATE].to(param.device, torch.float64, copy=True)
                self.learning_rate[self.group_index[param]] = eta

    def state_dict(self):
        return {
            "momentum": {k: v.clone() for k, v in self.momentum.items()},
            "decay": {k: v.clone() for k, v in self.decay.items()},
            # By parameter name, as each parameter's group rate.
            "learning_rate": {
                self._name(p): float(eta)
                for index, eta in self.learning_rate.items()
                for p in self.optimizer.param_groups[index]["params"]
            },
        }

    def load_state_dict(self, state, placed):
        """Restores ``state`` through ``placed``, which copies its tensors onto their devices.
        A ``state_dict()`` of the optimizer holds m and w in torch's ``state`` (``expose``,
        ``adopt``), not here."""
        self.momentum = placed(state.get("momentum", {}))
        self.decay = placed(state.get("decay", {}))
        rates = state["learning_rate"]
        self.learning_rate = {}
        for index, group in enumerate(self.optimizer.param_groups):
            saved = [rates[n] for n in map(self._name, group["params"]) if n in rates]
            if saved:
                self.learning_rate[index] = saved[0]
