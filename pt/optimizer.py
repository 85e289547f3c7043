"""``DistributedOptimizer``: a drop-in for ``horovod.torch.DistributedOptimizer`` that
compresses gradients with any codec of ``hvd_compress``."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import horovod.torch as hvd
import horovod.torch.optimizer as horovod_optimizer
import torch

from hvd_compress import agreement, remedies
from hvd_compress.adaptive import Adaptive
from hvd_compress.bucketing import BUCKET_BYTES
from hvd_compress.plan import classifier_names
from hvd_compress.registry import Compression, resolve
from hvd_compress.validation import (
    check_compressed_adam_codec,
    check_error_feedback,
    check_exchange,
    check_horovod_defaults,
    check_int,
    check_reduction,
)

from .codecs import CODECS
from .compressed_adam import CompressedAdam
from .momentum import WorkerMomentum
from .pipeline import CompressionPipeline

STATE_KEY = "hvd_compress"


def _on_grad(optimizer, param):
    """A parameter's gradient hook: ``optimizer`` (a weak reference) exchanges it."""
    optimizer = optimizer()
    if optimizer is not None:
        optimizer._hvdc_on_grad(param)


class _DistributedOptimizer:
    """Methods grafted onto a subclass of the user's optimizer class (see
    ``DistributedOptimizer``); the base class is called explicitly, never through ``super``,
    because these functions are copied into a class built at run time."""

    def _hvdc_setup(
        self,
        base,
        pipeline,
        backward_passes_per_step,
        worker_momentum,
        sparse_as_dense,
        compressed_adam,
    ):
        self._hvdc_base = base
        self._hvdc_pipeline = pipeline
        # Horovod's optimizer keeps {parameter: name} under this private name, sorted by name,
        # and code written against it reads it.
        self._parameter_names = {
            p: plan.name
            for p, plan in sorted(pipeline.plans.items(), key=lambda item: item[1].name)
        }
        self._hvdc_sparse_as_dense = sparse_as_dense
        self._hvdc_densified = {}  # parameter -> sparse_dim of the gradient it densified
        # A rank outside the process set steps on its own gradients, momentum and all.
        worker_momentum = worker_momentum if pipeline.included else None
        self._hvdc_momentum = (
            WorkerMomentum(self, pipeline, nesterov=worker_momentum == "nesterov")
            if worker_momentum
            else None
        )
        self._hvdc_adam = (
            CompressedAdam(self, pipeline, compressed_adam)
            if compressed_adam and pipeline.included
            else None
        )
        # Settings that a rank's own options can decide, and that make ranks exchange at
        # other times or compute other things: compared at the first step.
        pipeline.agree_on(
            agreement.modes(
                backward_passes_per_step=backward_passes_per_step,
                sparse_as_dense=sparse_as_dense,
                # Whether, not in which form: the form follows the groups' Nesterov
                # option, which hvd.broadcast_optimizer_state makes alike after this.
                worker_momentum=worker_momentum is not None,
                compressed_adam=compressed_adam if pipeline.included else None,
            )
        )
        self._hvdc_passes = backward_passes_per_step
        self._hvdc_delay = {p: backward_passes_per_step for p in pipeline.plans}
        self._hvdc_launched = set()
        self._hvdc_synchronized = False
        self._hvdc_should_synchronize = True
        # The hooks hold the optimizer weakly: a parameter keeps its hooks in a dict that
        # torch's C++ side holds, beyond the garbage collector's sight, so a hook holding
        # the optimizer (which holds the parameters) kept both alive after the user
        # dropped them.
        on_grad = functools.partial(_on_grad, weakref.ref(self))
        self._hvdc_hooks = [
            p.register_post_accumulate_grad_hook(on_grad)
            for p in pipeline.plans
            if p.requires_grad and pipeline.included
        ]

    def _hvdc_on_grad(self, param):
        if param in self._hvdc_launched:
            raise RuntimeError(
                f"gradients were computed more than backward_passes_per_step="
                f"{self._hvdc_passes} times before step() or synchronize(); raise "
                f"backward_passes_per_step to accumulate more passes"
            )
        self._hvdc_delay[param] -= 1
        if self._hvdc_delay[param] == 0:
            self._hvdc_launched.add(param)
            self._hvdc_densify(param)
            self._hvdc_pipeline.clip_locally(param)
            self._hvdc_pipeline.begin(param)
            lr_ratio, momentum = 1.0, None
            if self._hvdc_momentum is not None:
                lr_ratio, momentum = self._hvdc_momentum.before_exchange(
                    param, defer=self._hvdc_pipeline.fuses(param)
                )
            if self._hvdc_adam is not None:
                self._hvdc_adam.before_exchange(param)
            self._hvdc_pipeline.launch(param, lr_ratio, momentum)

    def _hvdc_densify(self, param):
        """With ``sparse_as_dense``, replaces a sparse gradient by its dense form when it is
        read for the exchange, as Horovod does: a tensor hook may not change a gradient's
        layout, and gradients accumulated over several backward passes stay sparse until
        then. ``synchronize`` makes the average sparse again with the same ``sparse_dim``,
        for optimizers that take only sparse gradients (``SparseAdam``)."""
        grad = param.grad
        if self._hvdc_sparse_as_dense and grad is not None and grad.is_sparse:
            self._hvdc_densified[param] = grad.sparse_dim()
            param.grad = grad.to_dense()

    def synchronize(self) -> None:
        """Waits for every gradient exchange of this step and writes the averaged
        gradients into ``.grad``. Call it before gradient clipping, then ``step()`` inside
        ``skip_synchronize()``. On a rank outside the process set the gradients stay its
        own, as with Horovod's optimizer."""
        if not self._hvdc_pipeline.included:
            self._hvdc_synchronized = True
            return
        missing = [
            p for p in self._hvdc_pipeline.plans if p.requires_grad and p not in self._hvdc_launched
        ]
        for param in missing:
            self._hvdc_densify(param)
            if self._hvdc_adam is not None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._hvdc_adam.before_exchange(param)
        self._hvdc_pipeline.synchronize(missing)
        if self._hvdc_momentum is not None:
            self._hvdc_momentum.after_exchange()
        if self._hvdc_adam is not None:
            self._hvdc_adam.after_exchange()
        for param, sparse_dim in self._hvdc_densified.items():
            param.grad = param.grad.to_sparse(sparse_dim)
        self._hvdc_densified.clear()
        self._hvdc_launched.clear()
        self._hvdc_delay = dict.fromkeys(self._hvdc_delay, self._hvdc_passes)
        self._hvdc_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (it already happened)."""
        self._hvdc_should_synchronize = False
        try:
            yield
        finally:
            self._hvdc_should_synchronize = True

    def step(self, closure=None):
        if self._hvdc_should_synchronize:
            if self._hvdc_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() "
                    "after optimizer.synchronize(): this synchronizes twice and "
                    "exchanges already averaged gradients again.",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvdc_synchronized = False
        if self._hvdc_adam is not None:
            return self._hvdc_adam_step(closure)
        if self._hvdc_momentum is None:
            return self._hvdc_base.step(self, closure)
        with self._hvdc_momentum.applied_by_worker():
            return self._hvdc_base.step(self, closure)

    def _hvdc_adam_step(self, closure):
        """The base Adam's step during compressed Adam's warm-up, its frozen-variance step
        after (``CompressedAdam``); then routes the next exchange."""
        if self._hvdc_adam.exchanged_momentum:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._hvdc_adam.step()
        else:
            loss = self._hvdc_base.step(self, closure)
        self._hvdc_adam.follow()
        return loss

    def zero_grad(self, set_to_none=True):
        if self._hvdc_pipeline.in_flight:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients being exchanged "
                "would be overwritten. Call zero_grad() before backward() or after step()."
            )
        return self._hvdc_base.zero_grad(self, set_to_none)

    def state_dict(self):
        state = self._hvdc_base.state_dict(self)
        state[STATE_KEY] = self._hvdc_pipeline.state_dict()
        if self._hvdc_momentum is not None:
            self._hvdc_momentum.expose(state["state"], state[STATE_KEY])
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if self._hvdc_momentum is not None:
            state_dict, momentum = self._hvdc_momentum.extract(state_dict)
        self._hvdc_base.load_state_dict(self, state_dict)
        if ours is not None:
            self._hvdc_pipeline.load_state_dict(ours)
            if self._hvdc_adam is not None:
                self._hvdc_adam.reload()
        if self._hvdc_momentum is not None:
            self._hvdc_momentum.adopt(momentum)

    def compression_stats(self) -> dict:
        """What the last step handed to Horovod, and how each tensor travels. ``"layers"``
        breaks the bytes down by layer kind (conv, linear, recurrent, embedding, other),
        with the density: the fraction of elements this worker sent (below 1 only for
        sparse codecs). With ``adaptive``, ``"adaptive"`` holds the last decision: the
        measured links, each tensor's path and the predicted exchange seconds per step of
        the chosen paths and of every unpinned tensor on one path (``Planner.report``).
        ``"compressed_adam"`` is compressed Adam's T_w, chosen or given, or None."""
        pipeline = self._hvdc_pipeline
        stats = pipeline.compression_stats()
        if pipeline.state.planner is not None:
            stats["adaptive"] = pipeline.state.planner.report()
        stats["compressed_adam"] = None if self._hvdc_adam is None else self._hvdc_adam.warmup_steps
        return stats


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``optimizer`` as ``hvd_compress.remedies`` knows it: ``"adam"`` (Adam, AdamW),
    ``"sgd"`` or ``"other"``."""
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return "other"


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Compression = "none",
    backward_passes_per_step: int = 1,
    op: int = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    *,
    exchange: str = "auto",
    seed: int = 0,
    uncompressed: Iterable[str] = (),
    error_feedback: bool | None = None,
    worker_momentum: bool | str | None = None,
    adaptive: bool | Adaptive = False,
    compressed_adam: int | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> torch.optim.Optimizer:
    """Wraps a ``torch.optim.Optimizer`` so that gradients are compressed, exchanged across
    the Horovod ranks of ``process_set`` and averaged before every ``step()``.

    The signature and behaviour follow ``horovod.torch.DistributedOptimizer``: gradient hooks
    start the exchange during the backward pass, ``step()`` waits for it; ``synchronize()``
    and ``skip_synchronize()`` allow gradient clipping; ``hvd.broadcast_parameters`` and
    ``hvd.broadcast_optimizer_state`` work unchanged. The result is an instance of a subclass
    of the optimizer's class that shares its state and parameter groups. Build learning-rate
    schedulers on the returned optimizer (one built on the original still sets the learning
    rate, through the shared parameter groups, but warns that ``step()`` was never called
    on it). Unlike Horovod's, the exchange also runs
    with a single process, so a one-process run trains with the same compression.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        named_parameters: ``model.named_parameters()``; names key the exchanges and the
            compression state. Without it parameters are named
            ``allreduce.noname.<group>.<index>``, as in Horovod.
        compression: a codec instance (``hvd_compress.pt.TernGrad(clip=2.5)``,
            ``hvd_compress.pt.AdaComp.for_model(model)``) or a registry name (``"none"``,
            ``"fp16"``, ``"terngrad"``, ``"adacomp"``, ``"clt-k"``, ...).
        backward_passes_per_step: backward passes accumulated locally before an exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: as in Horovod, for the uncompressed allreduces (sums of
            integer codes are exact, so compressed tensors do not need it).
        num_groups, groups: must be left unset; tensors are fused by Horovod's fusion buffer.
        sparse_as_dense: densify sparse gradients (sparse embeddings) when they are read for
            the exchange, so they can be compressed; the optimizer gets the average as a
            sparse gradient again, as in Horovod.
        process_set: the Horovod process set whose ranks average together (each
            data-parallel group of a model- or pipeline-parallel job); every collective,
            shared scale, shard and agreement check stays inside it. Ranks outside it step
            on their own gradients, as with Horovod's optimizer.
        exchange: ``"auto"`` (the cheapest by ``hvd_compress.cost`` for each tensor),
            ``"allreduce"``, ``"allgather"`` or ``"sharded"``; or ``"two-level"``: each
            node's ranks sum their gradients uncompressed (a reduce-scatter; for CPU
            tensors an allreduce), rank l of every node exchanges the codes of shard l
            with rank l of the others, and the node gathers the decoded shards
            (``hvd_compress.topology``; Horovod must be initialised with
            ``hvd.init(process_sets="dynamic")``).
        seed: base seed of the random streams of stochastic codecs; each (rank, step,
            tensor) draws from its own stream.
        uncompressed: parameter names always sent whole, in addition to those the codec
            leaves out (smaller than ``min_size``; the classifier unless
            ``compress_classifier``).
        error_feedback: keep, per compressed tensor, what its messages did not carry and add
            it to the next gradient. None: the codec's default (on for ``ef-sign``, and
            always on for the sparse codecs ``adacomp``, ``clt-k``, ``dgc`` and
            ``powersgd``).
        worker_momentum: dist-EF-blockSGDM's optimizer mode, for ``torch.optim.SGD``: the
            momentum is applied on each worker *before* compression, residuals are rescaled
            by eta_{t-1} / eta_t when the learning rate changes, and after the exchange the
            step adds weight decay with its own momentum buffer, so no momentum is applied
            twice (``WorkerMomentum``); it is DGC's momentum correction. True: in the SGD's
            form of momentum (heavy-ball or Nesterov's); ``"nesterov"``: in Nesterov's form
            whatever the SGD's. None (default): on for ``ef-sign`` and ``dgc`` with an SGD
            that has momentum, in Nesterov's form, as dist-EF-blockSGDM's
            (``hvd_compress.remedies``; logged once where the SGD's is heavy-ball).
        adaptive: ``True`` or an ``hvd_compress.Adaptive``: every tensor the codec
            compresses goes by the codec, an fp16 allreduce or a plain allreduce, whichever
            a model of the step predicts fastest from the link, codec and backward times
            measured on this job (``hvd_compress.adaptive``); decided after a warm-up, again
            every ``Adaptive.every`` steps, the same on every rank. A tensor that leaves the
            codec sends its error-feedback residuals with its next allreduce. Dense codecs
            only. Default False: every compressible tensor by the codec.
        compressed_adam: 1-bit Adam's mode for ``torch.optim.Adam`` and ``AdamW``, with
            this many uncompressed warm-up steps T_w (an int >= 1): the first T_w steps
            are the base optimizer's on gradients averaged by fp32 allreduces; then Adam's
            variance is frozen and each worker's momentum, not its gradient, goes through
            the codec (``CompressedAdam``). The remedy for codecs that lean on error
            feedback (ef-sign, AdaComp, CLT-k, DGC), which disturb Adam's variance when they
            compress its gradients. None (default): on, with T_w = 200, for those codecs
            under Adam and AdamW (logged once; ``hvd_compress.remedies``), off otherwise;
            0: off, the gradients go through the codec.
        bucket_bytes: off the CPU kernels (eager ops on a GPU, or with
            ``HVD_COMPRESS_KERNELS=0``), TernGrad's and the QSGD family's tensors that
            travel by one exchange are laid out in gradient buckets of this many float32
            bytes and coded once per bucket, as DDP's buckets are allreduced
            (``hvd_compress.bucketing``): the same codes, residuals and averages as tensor
            by tensor, with a few launches per bucket instead of per tensor. Default 25 MiB
            (DDP's ``bucket_cap_mb``); 0 codes every tensor alone.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    codec = resolve(compression, CODECS)
    passes = check_int(
        "DistributedOptimizer", "backward_passes_per_step", backward_passes_per_step, low=1
    )
    average, (prescale, postscale) = check_reduction(
        "DistributedOptimizer", op, gradient_predivide_factor, average=hvd.Average, sum_=hvd.Sum
    )
    check_horovod_defaults("DistributedOptimizer", num_groups=num_groups, groups=groups)
    check_exchange("DistributedOptimizer", codec, exchange)
    seed = check_int("DistributedOptimizer", "seed", seed, low=0)
    bucket_bytes = check_int("DistributedOptimizer", "bucket_bytes", bucket_bytes, low=0)
    planner = Adaptive.of(adaptive)
    error_feedback = check_error_feedback("DistributedOptimizer", codec, error_feedback)
    sgd_momentum = isinstance(optimizer, torch.optim.SGD) and any(
        group["momentum"] > 0 for group in optimizer.param_groups
    )
    worker_momentum = remedies.worker_momentum(
        "DistributedOptimizer",
        codec,
        worker_momentum,
        sgd_momentum=sgd_momentum,
        heavy_ball=sgd_momentum
        and any(g["momentum"] > 0 and not g["nesterov"] for g in optimizer.param_groups),
    )
    remedies.nesterov_gap(
        "DistributedOptimizer",
        codec,
        nesterov=sgd_momentum and any(g["nesterov"] for g in optimizer.param_groups),
    )
    if worker_momentum:
        WorkerMomentum.check(optimizer)
    compressed_adam = remedies.compressed_adam(
        "DistributedOptimizer",
        codec,
        optimizer_kind(optimizer),
        type(optimizer).__name__,
        compressed_adam,
        refusal=CompressedAdam.refusal(optimizer)
        or ("does not combine with adaptive" if planner is not None else None),
    )
    if compressed_adam is not None:
        compressed_adam = CompressedAdam.check(optimizer, compressed_adam)
        check_compressed_adam_codec("DistributedOptimizer", codec)
        if planner is not None:
            raise ValueError(
                "DistributedOptimizer: compressed_adam chooses each step's path itself; "
                "it does not combine with adaptive"
            )

    named = _named_parameters(optimizer, named_parameters)
    sent_whole = set(uncompressed)
    unknown = sent_whole - {name for name, _ in named}
    if unknown:
        raise ValueError(
            f"DistributedOptimizer: uncompressed names unknown parameters: {sorted(unknown)}"
        )
    if planner is not None:
        unpinnable = set(planner.pin) - {name for name, _ in named}
        if unpinnable:
            raise ValueError(
                f"DistributedOptimizer: adaptive pins unknown parameters: {sorted(unpinnable)}"
            )
    if not codec.compress_classifier:
        sent_whole |= classifier_names(named)
    pipeline = CompressionPipeline(
        named,
        codec,
        exchange=exchange,
        average=average,
        seed=seed,
        uncompressed=sent_whole,
        prescale_factor=prescale,
        postscale_factor=postscale,
        error_feedback=error_feedback,
        adaptive=planner,
        process_set=process_set,
        bucket_bytes=bucket_bytes,
    )

    wrapped = wrap_in_subclass(optimizer, _DistributedOptimizer, local_step=_local_step)
    wrapped._hvdc_setup(
        optimizer.__class__,
        pipeline,
        passes,
        worker_momentum,
        bool(sparse_as_dense),
        compressed_adam,
    )
    return wrapped


def _local_step(self, closure=None):
    """The base optimizer's step without an exchange: what ``hvd.broadcast_optimizer_state``
    runs with zero gradients (``super(type(opt), opt).step()``) to create the state of an
    optimizer that has none. In the worker-momentum mode the base SGD runs as plain SGD, as
    in every step of that mode, so this step creates no state either, and rank 0's loaded
    state stays what every rank ends with; with the groups' momentum on, it created
    ``momentum_buffer`` entries that no step of the mode reads."""
    if self._hvdc_momentum is None:
        return self._hvdc_base.step(self, closure)
    with self._hvdc_momentum.plain_sgd():
        return self._hvdc_base.step(self, closure)


def wrap_in_subclass(optimizer, methods, local_step=None):
    """An instance of a subclass of ``optimizer``'s class, built at run time with the
    methods of the class ``methods`` added, that shares ``optimizer``'s state, parameter
    groups and hooks. ``local_step``, if given, is what ``super(type(wrapped),
    wrapped).step()`` runs instead of the base class's ``step``: a class between the two
    holds it."""
    base = optimizer.__class__
    methods = {k: v for k, v in vars(methods).items() if not k.startswith("__")}
    # horovod.torch.broadcast_optimizer_state recognises a distributed optimizer by this
    # module name and then initialises its state with a *local* step of the base class
    # (super(type(opt), opt).step()); any other module gets a full step(), which would
    # start collectives on only the ranks whose state is empty and hang.
    methods["__module__"] = horovod_optimizer.DistributedOptimizer.__module__
    parent = (
        base
        if local_step is None
        else type(base.__name__, (base,), {"step": local_step, "__module__": __name__})
    )
    cls = type(base.__name__, (parent,), methods)
    wrapped = cls.__new__(cls)
    # Share the state, parameter groups and hooks of the given optimizer, but not
    # instance-level overrides of our methods (LR schedulers wrap ``opt.step`` that way).
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in methods})
    return wrapped


def _named_parameters(optimizer, named_parameters):
    """(name, parameter) pairs for every parameter of the optimizer, checked like Horovod."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
    named = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) "
            "pairs, usually model.named_parameters()"
        )
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    by_id = {id(p): name for name, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(
            f"named_parameters lacks {len(unnamed)} of the optimizer's "
            f"parameters (positions {unnamed[:10]} in its param_groups)"
        )
    return [(by_id[id(p)], p) for p in params]
