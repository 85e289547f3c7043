"""CELGC: local SGD with per-worker gradient clipping (Liu, Zhuang, Lei, Liao, NeurIPS 2022,
"Communication-Efficient Local Gradient Clipping", Algorithm 1 and the authors' code).

Every worker i steps on its own data with its own gradient and a clipped step size,

    x_i <- x_i - min(eta_t, gamma_t / ||g_i||) g_i       (||.||: the L2 norm over all layers)

and every I steps the workers average their parameters. That average is the only
communication: 32 / I bits per element and step, against 32 for synchronous SGD. Clipping
keeps the local steps safe where gradients explode (recurrent networks): a step moves the
weights by at most gamma_t, so between two averages a worker drifts at most I gamma_t from
the others' mean (the paper's Lemma 1).

Schedule. Algorithm 1 averages at the start of every iteration t with t mod I = 0, before the
gradient of that iteration is computed. ``step()`` receives a gradient that is already
computed, so the average for iteration t runs at the end of step t - 1: after every I-th
local step. Iteration 0's average is the ``hvd.broadcast_parameters`` that every Horovod
program starts with, so T calls of ``step()`` make floor(T / I) averaging rounds, and after
any multiple of I steps all ranks hold the same parameters.
"""

from __future__ import annotations

import contextlib

import horovod.torch as hvd
import torch

from hvd_compress.plan import classifier_names
from hvd_compress.registry import Compression, resolve
from hvd_compress.validation import check_bool, check_choice, check_float, check_int

from .codecs import CODECS
from .exchange import (
    Meter,
    allreducible,
    grouped_allreduce_async,
    grouped_allreduce_in_place,
    wait,
)
from .optimizer import STATE_KEY, _named_parameters, wrap_in_subclass
from .pipeline import CompressionPipeline

CLIPPINGS = ("local", "global_average", "max")

# Parameter-group option: gamma / eta_0, the gradient norm above which a step is clipped.
# A group option because schedulers change each group's eta_t, state_dict() saves it and
# hvd.broadcast_optimizer_state sends it.
MAX_GRAD_NORM = "max_grad_norm"


class _LocalClipSGD:
    """Methods grafted onto a subclass of the user's SGD class (see ``LocalClipSGD``); the
    base class is called explicitly, never through ``super``, as in ``DistributedOptimizer``."""

    def _hvdc_setup(self, base, named, buffers, sync_every, clipping, codec, pipeline):
        self._hvdc_base = base
        self._hvdc_codec = codec
        self._hvdc_named = named
        self._hvdc_buffers = buffers
        self._hvdc_sync_every = sync_every
        self._hvdc_clipping = clipping
        self._hvdc_pipeline = pipeline
        # With a codec, what travels is each worker's move since the last round, added to the
        # parameters of that round (the anchors), which every rank holds alike. They are taken
        # at the first step, after hvd.broadcast_parameters.
        self._hvdc_anchors = {}
        self._hvdc_meter = Meter()
        self._hvdc_steps = 0
        self._hvdc_average_grad_norm = None  # ||g_bar|| ("global_average", "max")
        self.syncs = 0  # averaging rounds made by this process
        self.last_step_bytes = 0  # bytes handed to Horovod by the last step()

    @property
    def local_steps(self):
        """Calls of ``step()`` so far (saved by ``state_dict()``); they position the rounds."""
        return self._hvdc_steps

    def step(self, closure=None):
        """One local clipped step; after every ``sync_every``-th, the parameters are averaged."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._hvdc_meter.bytes = 0
        if self._hvdc_pipeline is not None and not self._hvdc_anchors:
            self._hvdc_anchors = {name: p.detach().clone() for name, p in self._hvdc_named}
        if self._hvdc_clipping != "local" and self._hvdc_steps % self._hvdc_sync_every == 0:
            self._hvdc_average_grad_norm = self._hvdc_averaged_gradient_norm()
        with self._hvdc_clipped_rates(self._hvdc_clipping_norm()):
            self._hvdc_base.step(self)
        self._hvdc_steps += 1
        if self._hvdc_steps % self._hvdc_sync_every == 0:
            self._hvdc_average()
        self.last_step_bytes = self._hvdc_meter.bytes
        return loss

    def _hvdc_clipping_norm(self):
        """The norm that decides the step size, by the ``clipping`` option."""
        if self._hvdc_clipping == "global_average":
            return self._hvdc_average_grad_norm
        grads = [p.grad for _, p in self._hvdc_named if p.grad is not None]
        local = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if self._hvdc_clipping == "max":
            return max(local, self._hvdc_average_grad_norm)
        return local

    def _hvdc_averaged_gradient_norm(self):
        """||g_bar||, the norm of the average of all workers' gradients (one more allreduce)."""
        # Every rank must hand over the same tensors, also for parameters without a gradient.
        grads = [
            self._hvdc_meter.hand(allreducible(torch.zeros_like(p) if p.grad is None else p.grad))
            for _, p in self._hvdc_named
        ]
        averaged = wait(
            grouped_allreduce_async(grads, op=hvd.Average, name="hvdc.local_sgd.gradients")
        )
        return float(torch.nn.utils.get_total_norm(averaged))

    @contextlib.contextmanager
    def _hvdc_clipped_rates(self, norm):
        """Runs the base step at min(eta_t, gamma_t / ||g||) with gamma_t = gamma eta_t / eta_0,
        that is eta_t (gamma / eta_0) / ||g|| where ||g|| exceeds gamma / eta_0. Like the
        authors' code, the clipped rate scales the whole SGD direction (momentum and weight
        decay included)."""
        rates = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            if norm > group[MAX_GRAD_NORM]:
                group["lr"] = group["lr"] * group[MAX_GRAD_NORM] / norm
        try:
            yield
        finally:
            for group, rate in zip(self.param_groups, rates):
                group["lr"] = rate

    @torch.no_grad()
    def _hvdc_average(self):
        """One averaging round: the parameters by one grouped allreduce (or the codec), the
        floating-point buffers by another."""
        if self._hvdc_pipeline is None:
            grouped_allreduce_in_place(
                [p.detach() for _, p in self._hvdc_named],
                hvd.Average,
                "hvdc.local_sgd.parameters",
                self._hvdc_meter,
            )
        else:
            self._hvdc_exchange_moves()
        if self._hvdc_buffers:
            grouped_allreduce_in_place(
                self._hvdc_buffers, hvd.Average, "hvdc.local_sgd.buffers", self._hvdc_meter
            )
        self.syncs += 1

    def _hvdc_exchange_moves(self):
        """Averages the moves x_i - anchor through the codec, with error feedback (what a
        round does not carry is added to the next round's move; it is in parameter units, so
        learning-rate changes need no rescaling). Every rank adds the same average to the
        same anchor, so all end bitwise equal."""
        pipeline, anchors = self._hvdc_pipeline, self._hvdc_anchors
        # The pipeline exchanges what is in .grad: the moves go there for the round, and the
        # gradients come back afterwards.
        gradients = {}
        for name, p in self._hvdc_named:
            gradients[name] = p.grad
            p.grad = p.detach() - anchors[name]
            pipeline.launch(p)
        pipeline.synchronize(())
        self._hvdc_meter.bytes += pipeline.last_step_bytes
        for name, p in self._hvdc_named:
            p.copy_(anchors[name].add_(p.grad))
            p.grad = gradients[name]

    def state_dict(self):
        state = self._hvdc_base.state_dict(self)
        ours = {"local_steps": self._hvdc_steps, "average_grad_norm": self._hvdc_average_grad_norm}
        if self._hvdc_pipeline is not None:
            ours["anchors"] = {name: a.clone() for name, a in self._hvdc_anchors.items()}
            ours["pipeline"] = self._hvdc_pipeline.state_dict()
        state[STATE_KEY] = ours
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        self._hvdc_base.load_state_dict(self, state_dict)
        if ours is None:
            return
        self._hvdc_steps = int(ours["local_steps"])
        self._hvdc_average_grad_norm = ours["average_grad_norm"]
        if self._hvdc_pipeline is not None:
            self._hvdc_anchors = self._hvdc_pipeline.placed(ours["anchors"])
            self._hvdc_pipeline.load_state_dict(ours["pipeline"])

    def compression_stats(self):
        """What the last step handed to Horovod, and how each tensor travels at a round."""
        pipeline = self._hvdc_pipeline
        if pipeline is None:
            tensors = [
                (name, p.numel(), "grouped allreduce", "parameters averaged whole")
                for name, p in self._hvdc_named
            ]
        else:
            tensors = [
                (plan.name, plan.numel, plan.exchange, plan.reason)
                for plan in pipeline.plans.values()
            ]
        return {
            "codec": repr(self._hvdc_codec),
            "step": self._hvdc_steps,
            "syncs": self.syncs,
            "bytes_handed": self.last_step_bytes,
            # What synchronous SGD's plain allreduce of every gradient hands each step.
            "bytes_uncompressed": sum(p.numel() * p.element_size() for _, p in self._hvdc_named),
            "tensors": tensors,
        }


def LocalClipSGD(
    optimizer: torch.optim.SGD,
    model: torch.nn.Module,
    *,
    clip: float,
    sync_every: int = 8,
    clipping: str = "local",
    average_buffers: bool = True,
    compression: Compression = "none",
    seed: int = 0,
) -> torch.optim.SGD:
    """Wraps a ``torch.optim.SGD`` so that every Horovod rank trains locally with clipped
    steps and the ranks average their models every ``sync_every`` steps (CELGC).

    Use it where ``hvd.DistributedOptimizer`` would go; it exchanges no gradients::

        optimizer = hc.LocalClipSGD(torch.optim.SGD(model.parameters(), lr=0.5), model,
                                    clip=0.05, sync_every=8)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    The result is an instance of a subclass of the optimizer's class that shares its state
    and parameter groups, so ``isinstance``, learning-rate schedulers and Horovod's
    broadcasts work as before. Every rank must start from the same parameters (broadcast
    them) and take the same number of steps; a step skipped on one rank only (a
    ``GradScaler`` that met an overflow there) would shift its averaging rounds against the
    others'. ``state_dict()`` adds the step counter (which positions the rounds) and, with a
    codec, the parameters of the last round and the error-feedback residuals; load it on
    every rank.

    Momentum buffers stay local, never averaged (as in the authors' code). Momentum and
    weight decay are allowed, the clipped rate then scales the whole SGD direction; the
    paper analyses plain SGD.

    Args:
        optimizer: the ``torch.optim.SGD`` to wrap (each parameter group's learning rate is
            eta).
        model: the ``torch.nn.Module`` trained; its ``named_parameters()`` name the
            optimizer's parameters and its floating-point buffers are averaged with them.
        clip (float): gamma > 0, the largest distance one local step moves the weights at
            the learning rate the optimizer has when wrapped (eta_0). Steps whose gradient norm
            exceeds gamma / eta_0 are clipped; a scheduler that sets the rate to eta_t sets
            gamma_t = gamma eta_t / eta_0, keeping gamma / eta fixed as the paper's theory
            (gamma / eta = 5 (sigma + kappa)) and the authors' decay milestones do. The paper
            uses gamma = 1.0 with eta = 0.3 (ResNet-56) and gamma = 7.5 with eta = 30
            (AWD-LSTM).
        sync_every (int): I >= 1, local steps between two averaging rounds (the authors'
            ``communication_interval``, 8 by default; the paper runs 2 to 32). I = 1 with
            ``"local"`` clipping is not synchronous SGD: each worker clips its own gradient.
        clipping (str): which gradient norm ||g|| sets the step min(eta_t, gamma_t / ||g||),
            as the authors' ``clipping_option``:

            - ``"local"`` (the paper's algorithm): the worker's own gradient norm
              ||g_i||; no communication besides the rounds.
            - ``"global_average"``: ||g_bar||, the norm of the average of all workers'
              gradients at the first step after each round (one more allreduce of the
              gradients per round, which doubles the traffic), kept for the I steps of
              that period.
            - ``"max"``: max(||g_i||, ||g_bar||), with the same ||g_bar||.
        average_buffers (bool): average the model's floating-point buffers (BatchNorm
            running statistics) at every round, by one more allreduce. False keeps them per
            worker, as the authors' code does. Integer buffers (batch counters) are never
            averaged; every rank counts the same.
        compression: a codec instance or registry name for the rounds. ``"none"`` averages
            the parameters whole with one grouped allreduce. Any other codec compresses each
            worker's move since the last round, with error feedback, through the same
            exchanges as ``DistributedOptimizer`` (tensors under the codec's ``min_size``,
            and the classifier if the codec leaves it out, travel whole).
        seed (int): base seed of the random streams of stochastic codecs.
    """
    owner = "LocalClipSGD"
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(
            f"{owner}: optimizer must be a torch.optim.SGD (CELGC clips SGD "
            f"steps), got {type(optimizer).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{owner}: model must be the torch.nn.Module whose parameters the "
            f"optimizer trains, got {type(model).__name__}"
        )
    clip = check_float(owner, "clip", clip)
    if clip <= 0:
        raise ValueError(f"{owner}: clip (gamma) must be > 0, got {clip!r}")
    sync_every = check_int(owner, "sync_every", sync_every, low=1)
    check_choice(owner, "clipping", clipping, CLIPPINGS)
    check_bool(owner, "average_buffers", average_buffers)
    codec = resolve(compression, CODECS)
    seed = check_int(owner, "seed", seed, low=0)
    for index, group in enumerate(optimizer.param_groups):
        if not group["lr"] > 0:
            raise ValueError(
                f"{owner}: the learning rate of parameter group {index} must be "
                f"> 0 (the clip threshold is gamma / eta_0), got {group['lr']!r}"
            )

    named = _named_parameters(optimizer, model.named_parameters())
    buffers = (
        [b for _, b in model.named_buffers() if b.is_floating_point()] if average_buffers else []
    )
    pipeline = None
    if codec.code_space is not None:
        sent_whole = set() if codec.compress_classifier else classifier_names(named)
        pipeline = CompressionPipeline(
            named, codec, seed=seed, uncompressed=sent_whole, error_feedback=True
        )
    for group in optimizer.param_groups:
        group[MAX_GRAD_NORM] = clip / group["lr"]
    wrapped = wrap_in_subclass(optimizer, _LocalClipSGD)
    wrapped._hvdc_setup(type(optimizer), named, buffers, sync_every, clipping, codec, pipeline)
    return wrapped
