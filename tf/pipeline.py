"""The per-step wiring of compressed gradient exchange: codec -> exchange -> decode.

``CompressionPipeline`` owns what happens to each gradient between the moment the tape has
produced it and the moment the wrapped optimizer reads it back. It is kept apart from the
wrappers so that ``DistributedGradientTape``, the Keras ``DistributedOptimizer`` and tests
drive the same code. It is a ``tf.Module``: its step counter and error-feedback residuals
are variables, so it runs inside ``tf.function`` and ``tf.train.Checkpoint`` saves it. The
two-level exchange's stages are ``tf/two_level.py``'s ``TwoLevelSteps``.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import accounting, agreement, fusion
from hvd_compress.accounting import UNCOMPRESSED, Sent
from hvd_compress.adaptive import Adaptive, Planner, check_pipeline
from hvd_compress.cost import TF_ALLREDUCE_DTYPES, TWO_LEVEL
from hvd_compress.plan import classifier_names, plan_tensor
from hvd_compress.registry import resolve
from hvd_compress.server import ServerStep
from hvd_compress.validation import (
    check_error_feedback,
    check_exchange,
    check_global_membership,
    check_int,
    check_reduction,
    check_two_level_process_set,
)

from . import fused, seeding
from .adaptive import AdaptiveSteps
from .exchange import (
    Meter,
    codes_name,
    collective_name,
    make_exchange,
    make_sparse_exchange,
    mark_exchange_end,
    mark_exchange_start,
)
from .fusion import AlltoallFusion
from .memory import ErrorFeedback, FactorMemory
from .state import PipelineState
from .two_level import TwoLevelSteps
from .world import ElasticWorld
from .xla import refuse_xla


def uniforms(seed, rank, step, index, shape):
    """The uniform draws of tensor ``index`` of worker ``rank`` at ``step``: those of
    ``hvd_compress.seeding``, which the PyTorch port draws too. ``step`` may be a tensor,
    so a ``tf.function`` draws a new stream every step without retracing."""
    key = seeding.stream_seed(seed, rank, step, index)
    return tf.reshape(seeding.uniforms(key, tf.TensorShape(shape).num_elements()), shape)


class CompressionPipeline(AdaptiveSteps, ElasticWorld, TwoLevelSteps, tf.Module):
    """Compressed averaging (or summing) of gradients across the ranks of a Horovod
    process set.

    Args:
        named_variables: (name, variable) pairs, in a fixed order shared by all ranks.
        codec: a TensorFlow codec (``hvd_compress.tf.TernGrad`` ...).
        exchange: ``"auto"``, ``"allreduce"``, ``"allgather"``, ``"sharded"`` or
            ``"two-level"`` (``hvd_compress.topology``: on the global process set of a
            Horovod initialised with ``process_sets="dynamic"``).
        average: divide the sum by the world size (``op=Average``) or not (``op=Sum``).
        seed: base of the counter-based random streams (``uniforms``).
        uncompressed: names of variables to send whole whatever their size.
        prescale_factor, postscale_factor: Horovod's scaling of uncompressed allreduces.
        error_feedback: keep a worker residual per compressed tensor (``ErrorFeedback``).
            Two-way codecs also keep a server residual per tensor (or shard).
        process_set: the Horovod process set whose ranks average together: every
            collective, shard, scale and agreement check is theirs, and their world size and
            ranks are the set's. On a rank outside it ``reduce`` returns the gradients as
            they are (``included`` is False).
        modes: the wrapper's settings every rank must share (``agreement.modes``), checked
            with the rest of the configuration.
        adaptive: an ``hvd_compress.Adaptive``: each compressed tensor goes by the codec,
            an fp16 or an fp32 allreduce, whichever the model of ``hvd_compress.adaptive``
            predicts fastest from measurements of the running job (``tf/adaptive.py``);
            None (default) always by the codec.

    What it carries from one step to the next is ``state`` (``PipelineState``).
    """

    def __init__(
        self,
        named_variables,
        codec,
        *,
        exchange="auto",
        average=True,
        seed=0,
        uncompressed=(),
        prescale_factor=1.0,
        postscale_factor=1.0,
        error_feedback=False,
        process_set=hvd.global_process_set,
        modes=None,
        adaptive=None,
    ):
        super().__init__(name="hvd_compress")
        self.codec = codec
        self.average = average
        self.seed = seed
        self.process_set = process_set
        self.included = bool(process_set.included())
        check_global_membership(self.included, process_set is hvd.global_process_set, "tensorflow")
        self.world_size = process_set.size()
        # Outside the set the rank keeps no shard of a sharded server: rank 0's sizes stand in.
        self.rank = process_set.rank() if self.included else 0
        self.prescale_factor, self.postscale_factor = prescale_factor, postscale_factor
        self.exchange = exchange
        # The two-level exchange's layout, this rank's process sets, the exchange among
        # the nodes of each tensor's shards and whether a node averages by an allreduce
        # (``_join_nodes``).
        self.nodes = self.node_set = self.shard_set = None
        self.between_nodes = {}
        self.node_allreduce = False
        if exchange == TWO_LEVEL and self.included:
            check_two_level_process_set(process_set is hvd.global_process_set)
        self.meter = Meter()
        uncompressed = set(uncompressed)
        # Keras 3 variables give their shape as a tuple and their dtype as a string.
        self.shapes = [tf.TensorShape(variable.shape) for _, variable in named_variables]
        self.dtypes = [tf.as_dtype(variable.dtype) for _, variable in named_variables]
        self.plans = [
            plan_tensor(
                codec,
                name,
                index,
                tuple(shape.as_list()),
                dtype.is_floating,
                exchange,
                name in uncompressed,
                fused.applies(codec, variable),
            )
            for index, ((name, variable), shape, dtype) in enumerate(
                zip(named_variables, self.shapes, self.dtypes)
            )
        ]
        # What every rank must compress alike, and whether the ranks of this world have
        # checked it and taken one step counter (``_agree``, at the first step: a worker
        # that joins an elastic job builds its optimizer where the others do not).
        self._description = agreement.describe(
            codec,
            exchange,
            average,
            [
                (plan.name, shape, dtype.name, plan.reason)
                for plan, shape, dtype in zip(self.plans, self.shapes, self.dtypes)
            ],
            adaptive=adaptive,
        ) | (modes or {})
        self._agreed = False
        self._choose_exchanges()
        if exchange == TWO_LEVEL and self.included:
            self._join_nodes()
        planner = None
        if adaptive is not None:
            check_pipeline(codec, exchange)
            planner = Planner(
                adaptive, [plan.name for plan in self.plans if plan.reason == "compressed"]
            )
        with tf.init_scope():
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.last_step_bytes = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="last_step_bytes"
            )
            # Per variable, in the order of ``plans``: the last step's bytes handed to
            # Horovod and the elements this worker sent (``accounting.layer_stats``).
            self.last_tensor_bytes = tf.Variable(
                tf.zeros([len(self.plans)], tf.int64), trainable=False, name="last_tensor_bytes"
            )
            self.last_sent_elements = tf.Variable(
                tf.zeros([len(self.plans)], tf.int64), trainable=False, name="last_sent_elements"
            )
        worker = (
            ErrorFeedback(
                {plan.name: self._coded_numel(plan) for plan in self._encoded()}, name="worker"
            )
            if error_feedback
            else None
        )
        factors = (
            FactorMemory(
                {
                    plan.name: codec.initial_factor(seed, plan.index, plan.shape)
                    for plan in self.plans
                    if plan.exchange != UNCOMPRESSED
                },
                name="factors",
            )
            if codec.message == "factors"
            else None
        )
        # Everything the steps carry forward; ``_make_exchanges`` adds the server
        # residuals, an optimizer that applies a worker momentum the momentum.
        self.state = PipelineState(step, worker, None, factors, planner)
        self._make_exchanges()
        if planner is not None:
            self.follow_paths()

    def _encoded(self):
        """The plans of the tensors this rank encodes: all compressed ones but the
        two-level tensors of a job on one node, whose shards cross no network."""
        return [
            plan
            for plan in self.plans
            if plan.exchange != UNCOMPRESSED
            and (plan.exchange != TWO_LEVEL or plan.name in self.between_nodes)
        ]

    def _make_exchanges(self):
        """Each compressed tensor's exchange in this world, and the server residuals (zeros)
        that a two-way codec's exchanges keep."""
        count = self.world_size if self.average else 1
        if self.codec.sparse:
            # The exchange selects from the worker's memory, and updates it, itself.
            factors = self.state.factors
            self.exchanges = {
                plan.name: make_sparse_exchange(
                    self.codec,
                    plan,
                    self.world_size,
                    self.meter,
                    count,
                    self.state.worker,
                    self.state.step,
                    process_set=self.process_set,
                    **({"factors": factors} if factors is not None else {}),
                )
                for plan in self.plans
                if plan.exchange != UNCOMPRESSED
            }
        else:
            self.exchanges = {plan.name: self._make_exchange(plan) for plan in self._encoded()}
        if self.codec.two_way:
            self.state.server = ErrorFeedback(
                {
                    name: exchange.server_numel(self._coding_rank(name))
                    for name, exchange in self.exchanges.items()
                },
                name="server",
            )

    def _coded_numel(self, plan):
        """Elements that this rank encodes of ``plan``'s tensor: a two-level tensor's
        shard, padded (``Nodes.shard_length``), or the tensor."""
        if plan.exchange == TWO_LEVEL and self.nodes is not None:
            return self.nodes.shard_length(plan.numel)
        return plan.numel

    def _coding_rank(self, name):
        """This rank among the ranks of tensor ``name``'s compressed exchange."""
        return self.shard_set.rank() if name in self.between_nodes else self.rank

    def _make_exchange(self, plan):
        """The compressed exchange of ``plan``'s tensor: among all ranks of the process set,
        or a two-level tensor's shard's among the nodes."""
        if plan.exchange == TWO_LEVEL:
            name, world, ranks = (
                self.between_nodes[plan.name],
                self.nodes.cross_size,
                self.shard_set,
            )
        else:
            name, world, ranks = plan.exchange, self.world_size, self.process_set
        count = world if self.average else 1
        return make_exchange(
            name, self.codec, self._coded_numel(plan), world, self.meter, count, process_set=ranks
        )

    # ----- one step -----

    def clip_locally(self, grads):
        """``grads`` as this worker compresses them, before any momentum: clipped by codecs
        that clip locally (DGC), as they are otherwise; None stays None."""
        return [None if g is None else self.codec.local_clip(g, self.world_size) for g in grads]

    def fuses(self, index, grad):
        """Whether gradient ``index``'s worker error feedback runs in ``fused``'s CPU
        kernels, which can also take its momentum step (``WorkerMomentum.Deferred``)."""
        plan = self.plans[index]
        return (
            plan.kernels
            and self.state.worker is not None
            # The adaptive mode may send the gradient by an allreduce, momentum applied.
            and self.state.planner is None
            and plan.exchange not in (UNCOMPRESSED, TWO_LEVEL)
            and not self.codec.uncompressed_steps
            and grad is not None
            and not isinstance(grad, tf.IndexedSlices)
            and fused.on_host(self.codec, grad)
        )

    def reduce(self, grads, lr_ratio=1.0, uncompressed_step=None, momentum=None):
        """Exchanges one step's gradients, one per variable in the order of construction
        (None for a variable without a gradient: zeros are exchanged, because every rank
        must take part in the same collectives); returns the averaged (or summed) ones.
        ``lr_ratio`` (eta_{t-1} / eta_t, may be a tensor) rescales residuals kept in gradient
        units. ``uncompressed_step`` (a boolean, may be a tensor): this step every tensor goes by a
        plain allreduce, and no residual changes (compressed Adam's warm-up). ``momentum``:
        per gradient a ``WorkerMomentum.Deferred`` (only where ``fuses``) or None."""
        if len(grads) != len(self.plans):
            raise ValueError(
                f"CompressionPipeline: got {len(grads)} gradients for {len(self.plans)} variables"
            )
        refuse_xla("hvd_compress")
        if not self.included:
            self.state.step.assign_add(1)
            return list(grads)
        self._follow_world()
        if not self._agreed:
            self._agree()
        self.check_traced_world()
        mark_exchange_start(self.state.step, self.process_set)
        grads = [
            tf.zeros(shape, dtype) if grad is None else grad
            for grad, shape, dtype in zip(grads, self.shapes, self.dtypes)
        ]
        if self.codec.uncompressed_steps:
            # PowerSGD's start_iter: every tensor whole at first.
            warming_up = self.state.step < self.codec.uncompressed_steps
            uncompressed_step = (
                warming_up if uncompressed_step is None else uncompressed_step | warming_up
            )
        momentum = momentum or [None] * len(grads)
        if uncompressed_step is None:
            outputs = self._exchange(grads, lr_ratio, momentum)
        else:
            outputs = tf.cond(
                uncompressed_step,
                lambda: self._exchange_uncompressed(grads),
                lambda: self._exchange(grads, lr_ratio, momentum),
            )
        mark_exchange_end(outputs)
        counted = self.state.step.assign_add(1)
        if self.state.planner is not None:
            self._mark_step_end([outputs, counted])
        return outputs

    def _exchange_uncompressed(self, grads):
        """Every gradient by a plain allreduce, counted like ``_exchange``'s."""
        outputs = []
        for plan, grad in zip(self.plans, grads):
            with self.meter.charging(plan.name):
                outputs.append(self._plain(plan, grad))
        self._account([plan.numel for plan in self.plans])
        return outputs

    def _exchange(self, grads, lr_ratio, momentum):
        """Every gradient by its plan, committing the step's residuals."""
        fusions = self._fusion_groups()
        outputs = [None] * len(self.plans)
        sent_elements = [plan.numel for plan in self.plans]
        started = {}  # index -> (what the exchange's ``finish`` takes, the gradient's dtype)
        known = {}  # index -> whether its gradient is finite, as its exchange knows
        by_path = {}  # the adaptive mode's fusion groups: group -> [(index, plan, grad)]
        for index, (plan, grad, step) in enumerate(zip(self.plans, grads, momentum)):
            with self.meter.charging(plan.name):
                if plan.exchange == UNCOMPRESSED or isinstance(grad, tf.IndexedSlices):
                    # Sparse gradients (embeddings) go through Horovod's sparse allreduce
                    # unless sparse_as_dense densified them.
                    outputs[index] = self._plain(plan, grad)
                    if plan.name in fusions:
                        fusions[plan.name].withdraw(codes_name(plan))
                elif self.codec.sparse:
                    outputs[index] = self._sparse(plan, grad, lr_ratio)
                    sent_elements[index] = self.exchanges[plan.name].sent_elements
                elif self.state.planner is not None and plan.reason == "compressed":
                    by_path.setdefault(fusions.get(plan.name), []).append((index, plan, grad))
                elif plan.exchange == TWO_LEVEL:
                    started[index] = (
                        self._start_two_level(plan, grad, lr_ratio, fusions.get(plan.name)),
                        grad.dtype,
                    )
                else:
                    vector = tf.reshape(tf.cast(grad, tf.float32), [-1])
                    started[index] = (
                        self._start(plan, vector, lr_ratio, fusions.get(plan.name), step),
                        grad.dtype,
                    )
        for group, members in by_path.items():
            for (index, _, grad), (decoded, finite) in zip(
                members, self._by_paths(group, members, lr_ratio)
            ):
                outputs[index] = tf.cast(tf.reshape(decoded, self.shapes[index]), grad.dtype)
                if grad.dtype == tf.float32:  # a cast into another could overflow
                    known[index] = finite
        for index, (pending, dtype) in started.items():
            plan = self.plans[index]
            exchange = self.exchanges.get(plan.name)
            with self.meter.charging(plan.name):
                decoded = pending if exchange is None else exchange.finish(pending)
                if plan.exchange == TWO_LEVEL:
                    decoded = self._gather_shard(plan, decoded)
            outputs[index] = tf.cast(tf.reshape(decoded, self.shapes[index]), dtype)
            # A cast into another dtype could overflow: only an adopted result is known.
            # A two-level tensor's gathers shards that other ranks decoded.
            if (
                plan.exchange != TWO_LEVEL
                and exchange.finite is not None
                and dtype == decoded.dtype
            ):
                known[index] = exchange.finite
        if self.state.committed():
            unknown = [output for index, output in enumerate(outputs) if index not in known]
            self.state.commit(tf.reduce_all(tf.stack([self.all_finite(unknown), *known.values()])))
        self._account(sent_elements)
        return outputs

    def _account(self, sent_elements):
        """Records the step's bytes handed to Horovod, in all and per tensor, and the
        elements each tensor sent."""
        self.last_tensor_bytes.assign(
            tf.stack(
                [tf.cast(self.meter.by_tensor.get(plan.name, 0), tf.int64) for plan in self.plans]
            )
        )
        self.last_sent_elements.assign(tf.stack([tf.cast(n, tf.int64) for n in sent_elements]))
        self.last_step_bytes.assign(self.meter.take())

    @staticmethod
    def all_finite(grads):
        """Whether every exchanged gradient of this step is finite, as a boolean tensor; the
        same answer on every rank, since they all hold the same averages."""
        checks = [
            tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
            for g in grads
            if g.dtype.is_floating
        ]
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)

    def _plain(self, plan, grad):
        if not isinstance(grad, tf.IndexedSlices):
            self.meter.hand(grad)
        return hvd.allreduce(
            grad,
            op=hvd.Average if self.average else hvd.Sum,
            prescale_factor=self.prescale_factor,
            postscale_factor=self.postscale_factor,
            name=collective_name(plan),
            ignore_name_scope=True,
            process_set=self.process_set,
        )

    def _fusion_groups(self):
        """This step's ``AlltoallFusion`` of each sharded tensor (``hvd_compress.fusion``):
        among all ranks, and among the nodes for the shards of two-level tensors whose
        exchange between nodes is sharded."""
        sharded = [plan for plan in self.plans if plan.exchange == "sharded"]
        groups = self._groups(sharded, self.world_size, self.process_set, "hvdc.alltoall")
        if self.shard_set is not None:
            sharded = [
                plan for plan in self.plans if self.between_nodes.get(plan.name) == "sharded"
            ]
            groups.update(
                self._groups(
                    sharded,
                    self.nodes.cross_size,
                    self.shard_set,
                    "hvdc.nodes.alltoall",
                )
            )
        return groups

    def _groups(self, plans, world_size, process_set, prefix):
        """{name: its ``AlltoallFusion``} of the sharded ``plans`` among ``world_size`` ranks
        of ``process_set``."""
        by_name = {plan.name: plan for plan in plans}
        groups = {}
        member_lists = fusion.alltoall_groups(
            self.codec, [(plan.name, self._coded_numel(plan)) for plan in plans], world_size
        )
        for index, members in enumerate(member_lists):
            group = AlltoallFusion(
                [codes_name(by_name[m]) for m in members], f"{prefix}.{index}", process_set
            )
            groups.update(dict.fromkeys(members, group))
        return groups

    def _sparse(self, plan, grad, lr_ratio):
        vector = tf.reshape(tf.cast(grad, tf.float32), [-1])
        exchange = self.exchanges[plan.name]
        decoded = exchange(vector, lr_ratio, codes_name(plan))
        if self.state.momentum is not None and exchange.selected is not None:
            self.state.momentum.mask(plan.name, exchange.selected)
        return tf.cast(tf.reshape(decoded, grad.shape), grad.dtype)

    def _start(self, plan, vector, lr_ratio, alltoall_fusion, momentum=None):
        """Compensates (applying a ``momentum`` step, where ``fuses``), encodes and starts
        the exchange of the flat float32 ``vector`` (a two-level tensor's: its shard, among
        the nodes); returns what its ``finish`` takes."""
        name = collective_name(plan)
        exchange_name = self.between_nodes.get(plan.name, plan.exchange)
        process_set = self.shard_set if plan.name in self.between_nodes else self.process_set
        residual = None if self.state.worker is None else self.state.worker.residuals[plan.name]
        exchange = self.exchanges[plan.name]
        exchange.fusion = alltoall_fusion
        if self.codec.two_way:
            exchange.server = ServerStep(self.state.server, plan.name, lr_ratio)
        shared = self.codec.scaled and self.codec.shares_scale(exchange_name)
        # A two-level exchange's shard sets hold one rank of each node: the global rank
        # keeps every rank's draws its own.
        rank = hvd.rank() if plan.exchange == TWO_LEVEL else self.rank
        key = seeding.stream_seed(self.seed, rank, self.state.step, plan.index)
        if plan.kernels and not shared:
            payload, scale, kept = fused.compensated_encode(
                self.codec,
                exchange,
                vector,
                residual,
                lr_ratio,
                key,
                residual is not None,
                momentum,
            )
            if residual is not None:
                self.state.worker.propose(plan.name, kept)
            return exchange.start_packed(payload, scale, codes_name(plan))
        scale = None
        if residual is not None:
            if plan.kernels:
                vector, scale = fused.compensated_scale(
                    self.codec, vector, residual, lr_ratio, momentum
                )
            else:
                vector = self.state.worker.compensate(plan.name, vector, lr_ratio)
        if self.codec.scaled:
            if scale is None:
                scale = self.codec.local_scale(vector)
            if shared:
                scale = hvd.allreduce(
                    self.meter.hand(scale),
                    op=hvd.Max,
                    name=f"{name}.scale",
                    ignore_name_scope=True,
                    process_set=process_set,
                )
        if plan.kernels:
            payload, kept = fused.encode(
                self.codec, exchange, vector, scale, key, feedback=residual is not None
            )
            if residual is not None:
                self.state.worker.propose(plan.name, kept)
            return exchange.start_packed(payload, scale, codes_name(plan))
        draws = None
        if self.codec.stochastic:
            draws = seeding.uniforms(key, vector.shape[0])
        codes = self.codec.encode(vector, scale, draws)
        if self.state.worker is not None:
            sent = self.codec.decode(self.codec.values(codes), scale, 1)
            self.state.worker.update(plan.name, vector, sent)
        return exchange.start(codes, scale, codes_name(plan))

    # ----- accounting -----

    def _sent(self):
        """The last step's tensors as ``hvd_compress.accounting`` counts them."""
        tensor_bytes = self.last_tensor_bytes.numpy()
        sent_elements = self.last_sent_elements.numpy()
        return [
            Sent(
                plan.name,
                plan.layer,
                plan.numel,
                dtype.size,
                plan.route,
                plan.reason,
                int(tensor_bytes[plan.index]),
                int(sent_elements[plan.index]),
            )
            for plan, dtype in zip(self.plans, self.dtypes)
        ]

    def expected_bytes(self):
        """Bytes per step that the wire formats of ``hvd_compress.cost`` predict."""
        return accounting.expected_bytes(
            self.codec, self._sent(), self.world_size, TF_ALLREDUCE_DTYPES, self.nodes
        )

    def compression_stats(self):
        """What the last step handed to Horovod, and how each tensor travels
        (``accounting.compression_stats``)."""
        stats = accounting.compression_stats(
            self.codec,
            int(self.state.step.numpy()),
            int(self.last_step_bytes.numpy()),
            self._sent(),
        )
        if self.state.planner is not None:
            stats["adaptive"] = self.state.planner.report()
        return stats


def variable_name(variable):
    """A variable's unique name: the Keras 3 path (``"dense/kernel"``), else TensorFlow's."""
    return getattr(variable, "path", None) or variable.name


def check_options(
    owner,
    compression,
    classes,
    *,
    op,
    gradient_predivide_factor,
    process_set,
    exchange,
    seed,
    error_feedback,
    adaptive,
):
    """The codec and the ``CompressionPipeline`` keyword arguments for the user-facing
    arguments of a wrapper (``owner`` names it in error messages), checked like
    ``hvd_compress.pt``'s."""
    codec = resolve(compression, classes)
    adaptive = Adaptive.of(adaptive)
    if adaptive is not None:
        check_pipeline(codec, exchange)
    average, (prescale, postscale) = check_reduction(
        owner, op, gradient_predivide_factor, average=hvd.Average, sum_=hvd.Sum
    )
    return codec, dict(
        exchange=check_exchange(owner, codec, exchange),
        average=average,
        seed=check_int(owner, "seed", seed, low=0),
        prescale_factor=prescale,
        postscale_factor=postscale,
        error_feedback=check_error_feedback(owner, codec, error_feedback),
        process_set=process_set,
        adaptive=adaptive,
    )


def make_pipeline(owner, named_variables, codec, uncompressed, options, modes=None):
    """The ``CompressionPipeline`` of ``named_variables`` with ``check_options``'s
    ``options``; ``uncompressed`` names variables sent whole; ``modes`` the wrapper's
    settings every rank must share (``agreement.modes``)."""
    names = [name for name, _ in named_variables]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{owner}: variables with duplicate names: {duplicates}")
    sent_whole = set(uncompressed)
    unknown = sent_whole - set(names)
    if unknown:
        raise ValueError(f"{owner}: uncompressed names unknown variables: {sorted(unknown)}")
    adaptive = options.get("adaptive")
    if adaptive is not None:
        unpinnable = set(adaptive.pin) - set(names)
        if unpinnable:
            raise ValueError(f"{owner}: adaptive pins unknown variables: {sorted(unpinnable)}")
    if not codec.compress_classifier:
        sent_whole |= classifier_names(named_variables)
    return CompressionPipeline(
        named_variables, codec, uncompressed=sent_whole, modes=modes, **options
    )
