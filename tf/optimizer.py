"""``DistributedOptimizer``: a Keras optimizer wrapper that compresses gradients with any
codec of ``hvd_compress`` and averages them across Horovod ranks, for ``model.fit`` and
custom loops alike.

``horovod.tensorflow.keras.DistributedOptimizer`` averages in ``get_gradients`` /
``_compute_gradients``, which Keras 3 never calls (its ``train_step`` goes straight to
``apply_gradients``), so under Keras 3 it trains without averaging. This wrapper exchanges
in ``apply``, which ``apply_gradients`` and every Keras 3 training path go through; for a
Keras 2 optimizer (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``), whose training paths do not
go through ``apply``, it exchanges in ``apply_gradients``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvd_compress import agreement, remedies
from hvd_compress.adaptive import Adaptive
from hvd_compress.registry import Compression
from hvd_compress.validation import (
    check_bool,
    check_compressed_adam_codec,
    check_horovod_defaults,
    check_int,
)

from .codecs import CODECS
from .compressed_adam import CompressedAdam
from .local_aggregation import LocalAggregation
from .local_variables import LocalVariables
from .momentum import WorkerMomentum, keras2_class
from .pipeline import check_options, make_pipeline, variable_name
from .xla import leave_auto_xla_off


class _DistributedOptimizer:
    """Methods grafted onto a subclass of the user's optimizer class (see
    ``DistributedOptimizer``), with those of ``_Keras3`` or ``_Keras2``; the base class is
    called explicitly, never through ``super``, because these functions are copied into a
    class built at run time."""

    _hvdc_owner = "DistributedOptimizer"
    # Set by ``DistributedOptimizer`` on the instance (the checked options).
    _hvdc_worker_momentum: str | None
    _hvdc_compressed_adam: int | None
    _hvdc_local: LocalVariables

    def _hvdc_attach(self, variables):
        self._hvdc_variables = list(variables)
        variables = [v for v in variables if v not in self._hvdc_local]
        named = [(variable_name(v), v) for v in variables]
        self._hvdc_pipeline = make_pipeline(
            "DistributedOptimizer",
            named,
            self._hvdc_codec,
            self._hvdc_uncompressed,
            self._hvdc_options,
            # Settings that a rank's own optimizer can decide: compared with the rest.
            agreement.modes(
                sparse_as_dense=self._hvdc_sparse_as_dense,
                # Whether, not in which form, as in PyTorch's.
                worker_momentum=self._hvdc_worker_momentum is not None,
                compressed_adam=self._hvdc_compressed_adam,
            ),
        )
        # An attribute of the optimizer (set outside Keras's untracked build), the pipeline's
        # step counter and residuals are saved by tf.train.Checkpoint(optimizer=...).
        # A rank outside the process set steps on its own gradients, momentum and all.
        worker_momentum = self._hvdc_worker_momentum if self._hvdc_pipeline.included else None
        self._hvdc_momentum = (
            WorkerMomentum(self._hvdc_pipeline, nesterov=worker_momentum == "nesterov")
            if worker_momentum
            else None
        )
        self._hvdc_adam = (
            CompressedAdam(self, self._hvdc_pipeline, variables, self._hvdc_compressed_adam)
            if self._hvdc_compressed_adam and self._hvdc_pipeline.included
            else None
        )
        self._hvdc_keys = [self._var_key(v) for v in variables]
        everything = self._hvdc_variables
        self._hvdc_pipeline.state.aggregation = (
            LocalAggregation(
                everything,
                [self._var_key(v) for v in everything],
                self._hvdc_passes,
                self._hvdc_average_passes,
            )
            if self._hvdc_passes > 1
            else None
        )

    def _hvdc_apply(self, grads, variables, apply_base):
        """Exchanges ``grads`` of ``variables`` and steps with ``apply_base(exchanged)``,
        returning what it returns; with ``backward_passes_per_step`` > 1, sums them and does
        so on every k-th call, returning None (``LocalAggregation``)."""

        def exchange_and_apply(grads):
            grads = self._hvdc_exchange(grads, variables)
            with self._hvdc_base_step():
                return apply_base(grads)

        aggregation = self._hvdc_pipeline.state.aggregation
        if aggregation is None:
            return exchange_and_apply(grads)
        keys = [self._var_key(v) for v in variables]
        # As Horovod's: the passes that do not step still count as iterations.
        aggregation.apply(
            list(grads), keys, exchange_and_apply, lambda: self.iterations.assign_add(1)
        )
        return None

    def register_local_var(self, var: Any) -> None:
        """As Horovod's: ``var``'s gradient is not exchanged; the base optimizer steps on
        this rank's own (divided by the process set's size if ``scale_local_gradients``).
        Every rank registers the same variables before the first step."""
        for name, value, off in (
            ("worker_momentum", self._hvdc_worker_momentum, "worker_momentum=False"),
            ("compressed_adam", self._hvdc_compressed_adam, "compressed_adam=0"),
        ):
            if value:
                # Both change the base optimizer's step for every variable, the local
                # ones included, which would then step without their momentum or variance.
                raise ValueError(
                    f"DistributedOptimizer: register_local_var is not available with "
                    f"{name}={value!r} (chosen or given), which replaces the base optimizer's "
                    f"step for every variable; pass {off} to keep local variables"
                )
        pipeline = getattr(self, "_hvdc_pipeline", None)
        if pipeline is not None and int(pipeline.state.step.numpy()) > 0:
            raise ValueError(
                "DistributedOptimizer: register_local_var after the first step; register "
                "local variables before training"
            )
        self._hvdc_local.register(var)
        if pipeline is not None:  # planned when Keras built the optimizer: plan again
            self._hvdc_attach(self._hvdc_variables)

    def _hvdc_exchange(self, grads, variables):
        """The averaged ``grads`` of ``variables`` (None stays None)."""
        grads = list(grads)
        if self._hvdc_sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        by_key = {self._var_key(v): g for v, g in zip(variables, grads)}
        # Variables without a gradient exchange zeros (every rank must take part in the same
        # collectives) and still reach the base optimizer without one.
        ordered, lr_ratio, uncompressed_step = (
            [by_key.get(key) for key in self._hvdc_keys],
            1.0,
            None,
        )
        ordered = self._hvdc_pipeline.clip_locally(ordered)
        momentum = None
        if self._hvdc_momentum is not None:
            defer = [self._hvdc_pipeline.fuses(i, g) for i, g in enumerate(ordered)]
            ordered, lr_ratio, momentum = self._hvdc_momentum.before_exchange(self, ordered, defer)
        if self._hvdc_adam is not None:
            ordered = self._hvdc_adam.before_exchange(ordered)
            uncompressed_step = ~self._hvdc_adam.compressing
        reduced = self._hvdc_pipeline.reduce(ordered, lr_ratio, uncompressed_step, momentum)
        if self._hvdc_adam is not None:
            reduced = self._hvdc_adam.after_exchange(reduced)
        reduced = dict(zip(self._hvdc_keys, reduced))

        def returned(variable, grad):
            if variable in self._hvdc_local:
                return self._hvdc_local.gradient(grad, self._hvdc_pipeline.world_size)
            return None if grad is None else reduced[self._var_key(variable)]

        return [returned(v, g) for v, g in zip(variables, grads)]

    def _hvdc_base_step(self):
        """The context of the base optimizer's step: without its momentum where the worker
        applied it."""
        if self._hvdc_momentum is None:
            return contextlib.nullcontext()
        return self._hvdc_momentum.applied_by_worker(self)

    def compression_stats(self) -> dict:
        """What the last step handed to Horovod, and how each tensor travels;
        ``"compressed_adam"`` is compressed Adam's T_w, chosen or given, or None."""
        stats = self._hvdc_pipeline.compression_stats()
        stats["compressed_adam"] = self._hvdc_compressed_adam
        return stats

    @property
    def compression_variables(self):
        """The step counter, error-feedback residuals and worker momentum
        (``tf.Variable``\\ s of the pipeline's ``PipelineState``)."""
        return list(self._hvdc_pipeline.variables)


class _Keras3:
    """The exchange of a Keras 3 optimizer: in ``build`` and ``apply``; compressed Adam's
    step in ``update_step``."""

    def build(self, variables):
        self._hvdc_base.build(self, variables)
        self._hvdc_attach(variables)

    # Unconverted by autograph, as ``DistributedGradientTape.gradient``.
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            variables = self._trainable_variables
        else:
            variables = list(trainable_variables)
            if not self.built:
                self.build(variables)
        return self._hvdc_apply(
            grads, variables, lambda g: self._hvdc_base.apply(self, g, trainable_variables)
        )

    def update_step(self, gradient, variable, learning_rate):
        if getattr(self, "_hvdc_adam", None) is None:
            return self._hvdc_base.update_step(self, gradient, variable, learning_rate)
        return self._hvdc_adam.update_step(self._hvdc_base, gradient, variable, learning_rate)


class _Keras2:
    """The exchange of a Keras 2 (``tf_keras``) optimizer: ``minimize`` and ``model.fit``
    go through ``apply_gradients``, whose first call plans the exchange for its variables."""

    # Unconverted by autograph, as ``DistributedGradientTape.gradient``.
    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads, variables = zip(*grads_and_vars)
        if getattr(self, "_hvdc_pipeline", None) is None:
            self._hvdc_attach(variables)
        result = self._hvdc_apply(
            grads,
            variables,
            lambda g: self._hvdc_base.apply_gradients(self, zip(g, variables), *args, **kwargs),
        )
        return self.iterations if result is None else result


def optimizer_kind(optimizer) -> str:
    """``optimizer`` as ``hvd_compress.remedies`` knows it: ``"adam"`` (Keras's Adam and
    AdamW, of Keras 3 or 2), ``"sgd"`` or ``"other"``."""
    adams = [keras.optimizers.Adam] + [keras2_class(name) for name in ("Adam", "AdamW")]
    if isinstance(optimizer, tuple(cls for cls in adams if cls is not None)):
        return "adam"
    if WorkerMomentum.is_sgd(optimizer):
        return "sgd"
    return "other"


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    compression: Compression = "none",
    op: int = hvd.Average,
    gradient_predivide_factor: float = 1.0,
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
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Wraps a Keras 3 optimizer so that gradients are compressed, exchanged across all
    Horovod ranks and averaged before every update, in ``model.fit`` and in
    ``optimizer.apply_gradients``.

    The result is an instance of a subclass of the optimizer's class (so ``isinstance``,
    ``get_config`` and learning-rate schedules behave as before) that shares the given
    optimizer's state. Its compression plan is made when Keras builds the optimizer on the
    model's variables. Broadcast the initial state with
    ``hvd_compress.tf.callbacks.BroadcastGlobalVariablesCallback``. XLA cannot compile
    Horovod's collectives: ``model.compile``'s default ``jit_compile="auto"``, which Keras 3
    turns on where a GPU is present, resolves to no XLA for a model with this optimizer
    (logged once; ``hvd_compress.tf.xla``), and ``jit_compile=True`` is refused with a
    ValueError.

    Args:
        optimizer: the ``keras.optimizers.Optimizer`` to wrap.
        compression: a codec instance (``hvd_compress.tf.TernGrad(clip=2.5)``) or a registry
            name (``"none"``, ``"fp16"``, ``"terngrad"``, ...).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: as in Horovod, for the uncompressed allreduces.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients (embeddings) so they can be
            compressed; otherwise they go through Horovod's sparse allreduce.
        process_set: the Horovod process set whose ranks average together; every
            collective, shared scale, shard and agreement check stays inside it. Ranks
            outside it keep their own gradients, as with Horovod's wrappers.
        exchange: ``"auto"`` (the cheapest by ``hvd_compress.cost`` for each tensor),
            ``"allreduce"``, ``"allgather"`` or ``"sharded"``; or ``"two-level"``: each
            node's ranks sum their gradients uncompressed (a reduce-scatter; for CPU
            tensors an allreduce), rank l of every node exchanges the codes of shard l
            with rank l of the others, and the node gathers the decoded shards
            (``hvd_compress.topology``; Horovod must be initialised with
            ``hvd.init(process_sets="dynamic")``).
        seed: base seed of the random streams of stochastic codecs.
        uncompressed: variable paths (``"dense/kernel"``) always sent whole, in addition to
            those the codec leaves out (smaller than ``min_size``; the classifier unless
            ``compress_classifier``).
        error_feedback: keep, per compressed tensor, what its messages did not carry and add
            it to the next gradient. None: the codec's default (on for ``ef-sign``, and
            always on for the sparse codecs ``adacomp``, ``clt-k``, ``dgc`` and
            ``powersgd``).
        worker_momentum: dist-EF-blockSGDM's optimizer mode, for ``keras.optimizers.SGD``:
            the momentum is applied on each worker *before* compression, residuals are
            rescaled by eta_{t-1} / eta_t when the learning rate changes, and the base step
            runs as plain SGD on the exchanged direction (with Keras's decoupled weight
            decay, outside compression), so no momentum is applied twice
            (``WorkerMomentum``); it is DGC's momentum correction. True: in the SGD's form
            of momentum (heavy-ball or Nesterov's); ``"nesterov"``: in Nesterov's form
            whatever the SGD's. None (default): on for ``ef-sign`` and ``dgc`` with an SGD
            that has momentum, in Nesterov's form, as dist-EF-blockSGDM's
            (``hvd_compress.remedies``; logged once where the SGD's is heavy-ball).
        adaptive: ``True`` or an ``hvd_compress.Adaptive``: every tensor the codec
            compresses goes by the codec, an fp16 allreduce or a plain allreduce, whichever
            a model of the step predicts fastest from the link and codec times measured on
            this job (``hvd_compress.adaptive``; how a traced step is measured:
            ``docs/adaptive.md``); decided after a warm-up, again every ``Adaptive.every``
            steps, the same on every rank, without tracing the step again. A tensor that
            leaves the codec sends its error-feedback residuals with its next allreduce.
            Dense codecs only. Default False: every compressible tensor by the codec.
        compressed_adam: 1-bit Adam's mode for ``keras.optimizers.Adam`` and ``AdamW``
            (Keras 3), with this many uncompressed warm-up steps T_w (an int >= 1): the
            first T_w steps are the base optimizer's on gradients averaged by fp32
            allreduces; then Adam's variance is frozen and each worker's momentum, not its
            gradient, goes through the codec (``CompressedAdam``). The remedy for codecs
            that lean on error feedback (ef-sign, AdaComp, CLT-k, DGC), which disturb Adam's
            variance when they compress its gradients. None (default): on, with
            T_w = 200, for those codecs under Adam and AdamW (logged once;
            ``hvd_compress.remedies``), off otherwise; 0: off, the gradients go through
            the codec.
        scale_local_gradients: as in Horovod, divide the gradients of the variables
            registered with ``register_local_var`` by the process set's size (default
            True).
        backward_passes_per_step: as in Horovod, k >= 1 calls of ``apply`` (batches of
            ``model.fit``) summed locally before one exchange and step; the other calls
            only advance ``iterations`` (``LocalAggregation``). Default 1.
        average_aggregated_gradients: divide the k passes' sum by k (default False: the
            sum, as Horovod).
        name, device_dense, device_sparse, num_groups, groups: Horovod's, taken at their
            defaults only (``validation.HOROVOD_DEFAULTS`` says why).
    """
    check_horovod_defaults(
        "DistributedOptimizer",
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        num_groups=num_groups,
        groups=groups,
    )
    local = LocalVariables("DistributedOptimizer", scale_local_gradients)
    passes = check_int(
        "DistributedOptimizer", "backward_passes_per_step", backward_passes_per_step, low=1
    )
    check_bool("DistributedOptimizer", "average_aggregated_gradients", average_aggregated_gradients)
    keras2 = keras2_class("Optimizer")
    methods: type
    if keras2 is not None and isinstance(optimizer, keras2):
        methods = _Keras2
    elif isinstance(optimizer, keras.optimizers.Optimizer):
        methods = _Keras3
    else:
        raise TypeError(
            f"optimizer must be a keras.optimizers.Optimizer (Keras 3) or a "
            f"tf_keras.optimizers.Optimizer (Keras 2), got {type(optimizer).__name__}"
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "DistributedOptimizer: the optimizer's gradient_accumulation_steps "
            "is not supported (it would apply what every pass exchanged); pass "
            "backward_passes_per_step to DistributedOptimizer instead, which sums the "
            "passes locally and exchanges once"
        )
    codec, options = check_options(
        "DistributedOptimizer",
        compression,
        CODECS,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        process_set=process_set,
        exchange=exchange,
        seed=seed,
        error_feedback=error_feedback,
        adaptive=adaptive,
    )
    sgd_momentum = WorkerMomentum.takes(optimizer)
    worker_momentum = remedies.worker_momentum(
        "DistributedOptimizer",
        codec,
        worker_momentum,
        sgd_momentum=sgd_momentum,
        heavy_ball=sgd_momentum and not optimizer.nesterov,
    )
    remedies.nesterov_gap(
        "DistributedOptimizer", codec, nesterov=sgd_momentum and bool(optimizer.nesterov)
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
        or ("does not combine with adaptive" if options["adaptive"] is not None else None),
    )
    if compressed_adam is not None:
        compressed_adam = CompressedAdam.check(optimizer, compressed_adam)
        check_compressed_adam_codec("DistributedOptimizer", codec)
        if options["adaptive"] is not None:
            raise ValueError(
                "DistributedOptimizer: compressed_adam chooses each step's path itself; "
                "it does not combine with adaptive"
            )
    if methods is _Keras3:
        leave_auto_xla_off()
    wrapped = wrap_in_subclass(optimizer, _DistributedOptimizer, methods)
    wrapped.__dict__.update(
        _hvdc_base=optimizer.__class__,
        _hvdc_codec=codec,
        _hvdc_options=options,
        _hvdc_uncompressed=frozenset(uncompressed),
        _hvdc_sparse_as_dense=sparse_as_dense,
        _hvdc_worker_momentum=worker_momentum,
        _hvdc_compressed_adam=compressed_adam,
        _hvdc_local=local,
        _hvdc_passes=passes,
        _hvdc_average_passes=average_aggregated_gradients,
    )
    if methods is _Keras3 and optimizer.built:
        wrapped._hvdc_attach(optimizer._trainable_variables)
    return wrapped


def wrap_in_subclass(optimizer, *method_classes):
    """An instance of a subclass of ``optimizer``'s class, built at run time with the
    methods of the classes ``method_classes`` added, that shares ``optimizer``'s state."""
    base = optimizer.__class__
    methods = {k: v for c in method_classes for k, v in vars(c).items() if not k.startswith("__")}
    cls = type(base.__name__, (base,), methods)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    return wrapped
