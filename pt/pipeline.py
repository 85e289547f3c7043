"""The per-step wiring of compressed gradient exchange: hook -> codec -> exchange -> decode.

``CompressionPipeline`` owns what happens to each gradient between the moment autograd has
produced it and the moment the wrapped optimizer reads it back. It is kept apart from the
optimizer class so that every wrapper (the optimizer, a local-SGD averager, tests) drives the
same code. This module holds its construction and its step: launching each gradient's
exchange as its hook fires (a ``Flight``, ``pt/flight.py``), and collecting the results.
Its world (the ranks, their nodes, agreement among them and elastic changes, checkpoints)
is ``pt/world.py``'s ``ElasticWorld``; the two-level exchange's stages are
``pt/two_level.py``'s ``TwoLevelSteps``; the adaptive mode's part of a step is
``pt/adaptive.py``'s ``AdaptiveSteps``.
"""

import collections
import functools
import time

import horovod.torch as hvd
import torch

from hvd_compress import accounting, agreement, cost, fusion
from hvd_compress.accounting import HALF, UNCOMPRESSED, Sent
from hvd_compress.adaptive import Planner, check_pipeline
from hvd_compress.bucketing import BUCKET_BYTES
from hvd_compress.cost import TWO_LEVEL
from hvd_compress.plan import plan_tensor
from hvd_compress.seeding import stream_seed
from hvd_compress.server import ServerStep
from hvd_compress.validation import check_global_membership, check_two_level_process_set

from . import fused, seeding, triton_fused
from .adaptive import AdaptiveSteps
from .bucketing import GradientBuckets
from .exchange import (
    Meter,
    allreduce_async,
    allreduce_async_,
    allreducible,
    codes_name,
    make_exchange,
    make_sparse_exchange,
    sparse_allreduce_async,
    wait,
)
from .flight import Flight
from .fusion import AlltoallFusion
from .memory import ErrorFeedback, FactorMemory
from .state import PipelineState
from .two_level import TwoLevelSteps
from .world import ElasticWorld

# The largest tensor (elements) whose finiteness ``all_finite`` reads together with the
# others': one op per step for all of them instead of one per tensor.
_SMALL_TENSOR = 1 << 16


def _write_grad(param, decoded):
    """Makes the decoded average ``param.grad``. A decoded tensor is new and nothing else
    holds it (or, for a gradient bucket on Triton's kernels, a view of the vector they
    decode the bucket into, which the next step's decode overwrites, as DDP's
    ``gradient_as_bucket_view`` does), so one of the gradient's dtype becomes the gradient
    itself, as autograd's own gradients do after ``zero_grad(set_to_none=True)``: copying
    it would be one more pass over every gradient."""
    if decoded.dtype == param.grad.dtype and decoded.is_contiguous():
        param.grad = decoded if decoded.shape == param.shape else decoded.view(param.shape)
    else:
        param.grad.copy_(decoded.reshape(param.grad.shape))


def _share_bytes(by_tensor, bucket):
    """Shares the bytes charged to ``bucket`` (and to the member whose gradient started its
    exchange) among its members by their elements, for the per-tensor accounting."""
    members = [m.plan for m in bucket.members]
    total = by_tensor.pop(bucket.name, 0) + sum(by_tensor.pop(m.name, 0) for m in members)
    numel = sum(m.numel for m in members)
    shares = [total * m.numel // numel for m in members]
    shares[-1] += total - sum(shares)
    by_tensor.update({m.name: share for m, share in zip(members, shares)})


class CompressionPipeline(ElasticWorld, TwoLevelSteps, AdaptiveSteps):
    """Compressed averaging (or summing) of gradients across the ranks of a Horovod
    process set.

    Args:
        named_parameters: (name, parameter) pairs, in a fixed order shared by all ranks.
        codec: a PyTorch codec (``hvd_compress.pt.TernGrad`` ...).
        exchange: ``"auto"``, ``"allreduce"``, ``"allgather"`` or ``"sharded"``.
        average: divide the sum by the world size (``op=Average``) or not (``op=Sum``).
        seed: base of the counter-based random streams (``hvd_compress.seeding``).
        uncompressed: names of parameters to send whole whatever their size.
        prescale_factor, postscale_factor: Horovod's scaling of uncompressed allreduces.
        error_feedback: keep a worker residual per compressed tensor (``ErrorFeedback``).
            Two-way codecs also keep a server residual per tensor (or shard).
        adaptive: an ``hvd_compress.Adaptive``: each compressed tensor goes by the codec,
            an fp16 or an fp32 allreduce, whichever the model of ``hvd_compress.adaptive``
            predicts fastest from measurements of this job. None: always by the codec.
        process_set: the Horovod process set whose ranks average together: every
            collective, shard, scale and decision is theirs, and their world size and ranks
            are the set's. On a rank outside it the pipeline exchanges nothing
            (``included`` is False) and only keeps its plans.
        bucket_bytes: the float32 bytes at which a gradient bucket closes
            (``hvd_compress.bucketing``): off the CPU kernels, the tensors of a codec that
            takes buckets travel in them, unless the adaptive mode or the two-level
            exchange chooses paths tensor by tensor. 0: every tensor alone.

    What it carries from one step to the next is ``state`` (``PipelineState``).
    """

    def __init__(
        self,
        named_parameters,
        codec,
        *,
        exchange="auto",
        average=True,
        seed=0,
        uncompressed=(),
        prescale_factor=1.0,
        postscale_factor=1.0,
        error_feedback=False,
        adaptive=None,
        process_set=hvd.global_process_set,
        bucket_bytes=BUCKET_BYTES,
    ):
        self.codec = codec
        # Steps at the start that send every compressed tensor whole (``follow_paths``):
        # the codec's (PowerSGD's ``start_iter``), or compressed Adam's warm-up, which sets it.
        self.uncompressed_steps = codec.uncompressed_steps
        self.average = average
        self.seed = seed
        self.process_set = process_set
        self.included = bool(process_set.included())
        check_global_membership(self.included, process_set is hvd.global_process_set, "torch")
        self.world_size = process_set.size()
        # Outside the set the rank exchanges nothing: rank 0 stands in where a rank is read.
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
        self.last_step_bytes = 0
        self._in_flight = {}
        self._begun = False  # whether this step has started (``begin``)
        # This step's flights whose codes wait for a collective, in the order they were
        # launched: two-level shards for their node's average (stage "shard"), and codes for
        # their shared scale (stage "scale"). Each hook looks at the heads of these, not at
        # every tensor launched so far (``_start_ready_codes``).
        self._waiting_shards = collections.deque()
        self._waiting_scales = collections.deque()
        self._fusions = {}  # name of a sharded tensor -> its AlltoallFusion of this step
        uncompressed = set(uncompressed)
        self.plans = {}
        for index, (name, p) in enumerate(named_parameters):
            self.plans[p] = plan_tensor(
                codec,
                name,
                index,
                tuple(p.shape),
                p.is_floating_point(),
                exchange,
                name in uncompressed,
            )
        self._choose_exchanges()
        if exchange == TWO_LEVEL and self.included:
            self._join_nodes()
        factors = (
            FactorMemory(
                {
                    plan.name: torch.from_numpy(
                        codec.initial_factor(seed, plan.index, plan.shape)
                    ).to(p.device)
                    for p, plan in self.plans.items()
                    if plan.reason == "compressed"
                }
            )
            if codec.message == "factors"
            else None
        )
        planner = None
        if adaptive is not None:
            check_pipeline(codec, exchange)
            planner = Planner(
                adaptive, [plan.name for plan in self.plans.values() if plan.reason == "compressed"]
            )
        # Everything the steps carry forward; an optimizer that applies a worker momentum
        # adds it.
        self.state = PipelineState(
            ErrorFeedback() if error_feedback else None,
            ErrorFeedback() if codec.two_way else None,
            factors,
            planner,
        )
        if planner is not None:
            self.follow_paths()
        self.bucket_bytes = bucket_bytes if planner is None and exchange != TWO_LEVEL else 0
        self.buckets = GradientBuckets(
            codec, self.bucket_bytes, self.plans, self.state, self.world_size, self.rank
        )
        # The exchange that kept each server residual of a restored state, until the next
        # step has brought them to this pipeline's exchanges (``load_state_dict``).
        self._restored_servers = {}
        self._step_started = None  # perf_counter() of the step's first gradient
        self._device = None  # where the last step's first gradient was
        self._measuring = False  # whether the planner measures this step's tensors
        # A measured step's blocks on a CUDA device, timed by CUDA events: (name, phase,
        # start, end, wall seconds), read when the step ends (``_spent_on_device``); None
        # where the thread's CPU time measures them.
        self._device_spans = None
        # What every rank must compress alike, and whether the ranks of this world have
        # checked it and taken one step counter (``_agree``).
        self._description = agreement.describe(
            codec,
            exchange,
            average,
            [(plan.name, p.shape, p.dtype, plan.reason) for p, plan in self.plans.items()],
            self.bucket_bytes,
            adaptive,
        )
        self._agreed = False
        self.last_tensor_bytes = collections.Counter()
        self.last_sent_elements = {}

    def agree_on(self, settings: dict) -> None:
        """Adds ``settings`` (``agreement.modes``) to what every rank must share, checked
        at the first step (``_agree``)."""
        self._description.update(settings)

    # ----- one step -----

    @property
    def in_flight(self):
        """Whether a step has begun and not yet been synchronized."""
        return self._begun

    def clip_locally(self, param):
        """Makes ``param.grad`` what this worker compresses, before any momentum: clipped
        by codecs that clip locally (DGC), as it is otherwise."""
        if param.grad is not None:
            param.grad = self.codec.local_clip(param.grad, self.world_size)

    def fuses(self, param):
        """Whether ``param``'s worker error feedback runs in ``fused``'s kernels, which can
        also take its momentum step (``WorkerMomentum.Deferred``)."""
        plan = self.plans[param]
        return (
            plan.route not in (UNCOMPRESSED, HALF, TWO_LEVEL)
            and param.grad is not None
            and self._compensates_in_kernels(param.grad)
        )

    def on_kernels(self, tensor):
        """Whether kernels encode ``tensor``, a gradient or its shard (``fused.applies``:
        the CPU kernels, or Triton's on a GPU): asked of each as it comes, so that a model
        moved or cast after its optimizer was wrapped sends its gradients where they can
        go, and the kernels never receive another device's memory."""
        return fused.applies(self.codec, tensor)

    def _compensates_in_kernels(self, vector):
        """Whether the worker error feedback of ``vector``, a gradient or its shard, runs in
        the CPU kernels (``fused.on_host``; on the device path it is the eager ops')."""
        return (
            fused.on_host(self.codec, vector)
            and self.state.worker is not None
            and not vector.is_sparse
            and vector.is_contiguous()
        )

    def begin(self, param):
        """Starts a step at its first gradient (``param``'s), once: takes the device and
        the world it finds, the paths and buckets of its tensors. The optimizer calls it
        before its momentum step, which asks whether a gradient travels in a bucket."""
        if self._begun:
            return
        self._begun = True
        self._follow_device(param.device)
        self._follow_world()
        self._follow_restored_servers()
        if not self._agreed:
            self._agree()
        self._step_started = time.perf_counter()
        if self.uncompressed_steps:
            self.follow_paths()
        self.buckets.follow()
        self._fusions = self._fusion_groups()
        self._start_measuring(param)

    def launch(self, param, lr_ratio=1.0, momentum=None):
        """Starts the exchange of ``param.grad``; called once per parameter per step.
        ``lr_ratio`` (eta_{t-1} / eta_t) rescales residuals kept in gradient units; a
        ``momentum`` (``WorkerMomentum.Deferred``, only where ``fuses``) is applied to the
        gradient on the way."""
        self.begin(param)
        plan = self.plans[param]
        self._ready(plan.name)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        with self.meter.charging(plan.name), self._timed(plan.name, "before"):
            if self.buckets.carries(plan.name):
                flight = self._fill_bucket(plan.name, grad, lr_ratio)
            else:
                self._launch(plan, param, grad, lr_ratio, momentum)
                flight = self._in_flight[param]
        if flight is None:
            return
        if flight.stage == "shard":
            self._waiting_shards.append(flight)
        elif flight.stage == "scale":
            self._waiting_scales.append(flight)
        self._start_ready_codes()

    def _follow_device(self, device):
        """Moves the state to ``device``, where this step's first gradient is, if the model
        moved there since the last step (``placed``): a residual, momentum buffer or factor
        left on the old device would meet gradients on the new one. Once per move, not per
        step or tensor."""
        if device != self._device:
            if self._device is not None:
                self.state.place(self.placed)
            self._device = device

    def _fill_bucket(self, name, grad, lr_ratio):
        """Copies tensor ``name``'s gradient into its bucket; with the last member's, starts
        the bucket's exchange, whose flight it returns (None before)."""
        layout = self.buckets.put(name, grad, lr_ratio)
        if layout is None:
            return None
        bucket = layout.bucket
        if self.state.momentum is not None:
            params = self.buckets.params[bucket.name]
            members = layout.members(layout.vector)
            self.state.momentum.accelerate(bucket, params, layout.vector, members)
        flight = Flight(
            bucket.plan,
            None,
            "scale",
            vector=layout.vector,
            lr_ratio=self.buckets.lr_ratio(layout),
            layout=layout,
        )
        self._start_scale(flight, None, bucket.exchange, self.world_size, self.process_set)
        self._in_flight[bucket.name] = flight
        return flight

    def _codec(self, flight):
        """The codec of ``flight``: a bucket's (its blocks are the bucket's), else the
        pipeline's."""
        return self.codec if flight.layout is None else flight.layout.codec

    def follow_paths(self):
        """Takes each compressed tensor's path for the next exchange: the one place that
        decides it. An fp32 allreduce during the ``uncompressed_steps`` at the start
        (PowerSGD's ``start_iter``, compressed Adam's warm-up), then the path the adaptive
        planner has in force, else the codec. A tensor that leaves its codec hands its
        server residual to its worker residual, which its next allreduce carries
        (``_launch_plain``)."""
        planner = self.state.planner
        for plan in self.plans.values():
            if plan.reason != "compressed":
                continue
            if self.state.step < self.uncompressed_steps:
                path = "fp32"
            else:
                path = "codec" if planner is None else planner.path(plan.name)
            if (
                plan.path == "codec"
                and path != "codec"
                and self.state.server is not None
                and plan.name in self.state.server.residuals
            ):
                self._server_residual_to_worker(plan, self.world_size)
            plan.path = path

    def _launch(self, plan, param, grad, lr_ratio, momentum):
        if plan.route in (UNCOMPRESSED, HALF) or grad.is_sparse:
            # Sparse gradients (sparse embeddings) go through Horovod's sparse allreduce
            # unless sparse_as_dense densified them.
            self._in_flight[param] = Flight(
                plan,
                param,
                "plain",
                result=self._launch_plain(plan, grad, lr_ratio, plan.route == HALF),
            )
            if plan.name in self._fusions:
                self._fusions[plan.name].withdraw(codes_name(plan.name))
        elif plan.exchange == TWO_LEVEL:
            self._in_flight[param] = self._launch_two_level(plan, param, grad, lr_ratio)
        elif self.codec.sparse:
            # The exchange selects from the worker's memory, and updates it, itself.
            flight = Flight(plan, param, "codes")
            flight.exchange = make_sparse_exchange(
                self.codec,
                plan,
                self.world_size,
                self.meter,
                self.world_size if self.average else 1,
                self.state.worker,
                self.state.step,
                process_set=self.process_set,
                **({"factors": self.state.factors} if self.state.factors is not None else {}),
            )
            flight.message = flight.exchange.start(
                grad.reshape(-1), lr_ratio, codes_name(plan.name)
            )
            if self.state.momentum is not None and flight.exchange.selected is not None:
                self.state.momentum.mask(plan.name, flight.exchange.selected)
            self._in_flight[param] = flight
        else:
            flight = Flight(
                plan,
                param,
                "scale",
                vector=grad.reshape(-1),
                fused=self.fuses(param),
                lr_ratio=lr_ratio,
            )
            self._start_scale(flight, momentum, plan.exchange, self.world_size, self.process_set)
            self._in_flight[param] = flight

    def _start_scale(self, flight, momentum, exchange, world_size, process_set):
        """Compensates ``flight.vector`` with its worker residual, computes its scale and
        starts the scale's Max-allreduce where ``exchange`` shares it among ``world_size``
        ranks of ``process_set``."""
        plan, codec = flight.plan, self._codec(flight)
        flight.handle = None
        # The QSGD family's own scales are taken in the encoding's pass over the gradient.
        flight.scale_in_encode = (
            fused.on_host(codec, flight.vector)
            and not codec.shares_scale(exchange)
            and fused.scales_in_encode(codec, flight.vector.numel())
        )
        if flight.fused:
            residual = self.state.worker.residuals.get(plan.name)
            grad = flight.vector
            if flight.scale_in_encode:
                flight.vector = fused.compensated(
                    self.codec, flight.vector, residual, flight.lr_ratio, momentum=momentum
                )
            else:
                flight.vector, flight.scale = fused.compensated_scale(
                    self.codec, flight.vector, residual, flight.lr_ratio, momentum=momentum
                )
            # The compensation returns the gradient itself where it has nothing to add.
            flight.compensated = flight.vector is not grad
        elif self.state.worker is not None:
            flight.vector = self.state.worker.compensate(plan.name, flight.vector, flight.lr_ratio)
        server = None
        if codec.two_way:
            lr_ratio = (
                flight.lr_ratio
                if flight.layout is None
                else flight.layout.server_lr_ratio(flight.lr_ratio)
            )
            server = ServerStep(self.state.server, plan.name, lr_ratio)
        flight.exchange = make_exchange(
            exchange,
            codec,
            flight.vector.numel(),
            world_size,
            self.meter,
            world_size if self.average else 1,
            server,
            self._fusions.get(plan.name),
            shards=None if flight.layout is None else flight.layout.shards,
            process_set=process_set,
        )
        if codec.scaled:
            if not flight.fused and not flight.scale_in_encode:
                flight.scale = codec.local_scale(flight.vector)
            if codec.shares_scale(exchange):
                flight.handle = allreduce_async(
                    self.meter.hand(flight.scale),
                    op=hvd.Max,
                    name=f"hvdc.{plan.name}.scale",
                    process_set=process_set,
                )
        flight.stage = "scale"

    def _fusion_groups(self):
        """This step's ``AlltoallFusion`` of each sharded tensor or gradient bucket
        (``hvd_compress.fusion``): among all ranks, and among the nodes for the shards of
        two-level tensors whose exchange between nodes is sharded."""
        sharded = self.buckets.units(
            [plan for plan in self.plans.values() if plan.route == "sharded"]
        )
        groups = self._groups(sharded, self.world_size, self.process_set, "hvdc.alltoall")
        if self.shard_set is not None:
            sharded = [
                (plan.name, self.nodes.shard_length(plan.numel))
                for plan in self.plans.values()
                if self.between_nodes.get(plan.name) == "sharded"
            ]
            cross_size = self.nodes.cross_size
            groups.update(self._groups(sharded, cross_size, self.shard_set, "hvdc.nodes.alltoall"))
        return groups

    def _groups(self, sharded, world_size, process_set, prefix):
        """{name: its ``AlltoallFusion``} of the ``sharded`` (name, numel) among
        ``world_size`` ranks of ``process_set``."""
        groups = {}
        for index, members in enumerate(fusion.alltoall_groups(self.codec, sharded, world_size)):
            group = AlltoallFusion(
                [codes_name(m) for m in members], f"{prefix}.{index}", process_set
            )
            groups.update(dict.fromkeys(members, group))
        return groups

    def _launch_plain(self, plan, grad, lr_ratio, half):
        """Starts the allreduce of a gradient sent whole, in float16 if ``half``; returns
        what waits for its output. A tensor that the adaptive mode took off its codec
        carries its residuals in it (``ErrorFeedback.flush``)."""
        name = f"hvdc.{plan.name}"
        op = hvd.Average if self.average else hvd.Sum
        if grad.is_sparse:
            return sparse_allreduce_async(grad, name=name, op=op, process_set=self.process_set)
        if self.state.worker is not None and plan.name in self.state.worker.residuals:
            grad = self.state.worker.flush(plan.name, grad.reshape(-1), lr_ratio).view(grad.shape)
        grad = allreducible(grad.to(torch.float16) if half else grad)
        self.meter.hand(grad)
        handle = allreduce_async_(
            grad,
            name=name,
            op=op,
            prescale_factor=self.prescale_factor,
            postscale_factor=self.postscale_factor,
            process_set=self.process_set,
        )
        return functools.partial(wait, handle)

    def _start_ready_codes(self, block=False):
        """Starts the nodes' exchange of every two-level shard that its node has summed,
        then encodes and hands over the codes of every tensor whose shared scale has
        arrived; with ``block``, waits for them all.

        Each queue is taken from its head and stops at the first flight still waiting:
        every rank submits the collectives in the same (backward) order and Horovod
        negotiates them in it, so a flight behind it is rarely ready first, and one that is
        starts at a later hook. Polling every waiting flight at every hook cost a number of
        polls per step quadratic in the number of tensors."""
        shards, scales = self._waiting_shards, self._waiting_scales
        while shards and (block or hvd.poll(shards[0].handle)):
            flight = shards.popleft()
            name = flight.plan.name
            with self.meter.charging(name), self._timed(name, "before"):
                flight.vector = self._own_shard(wait(flight.handle))
                self._start_shard(flight)
            if flight.stage == "scale":
                scales.append(flight)
        while scales:
            flight = scales[0]
            if flight.handle is not None:
                if not block and not hvd.poll(flight.handle):
                    break
                flight.scale = wait(flight.handle)
            scales.popleft()
            with self._timed(flight.plan.name, "before"):
                self._start_codes(flight)

    def _start_codes(self, flight):
        vector, name, codec = flight.vector, flight.plan.name, self._codec(flight)
        # A two-level exchange's shard sets hold one rank of each node: the global rank
        # keeps every rank's draws its own.
        rank = hvd.rank() if flight.plan.exchange == TWO_LEVEL else self.rank
        key = self._key(flight, rank)
        if self.on_kernels(vector):
            feedback = self.state.worker is not None
            if flight.scale_in_encode:
                codes, residual, flight.scale = fused.scaled_encode(
                    codec, flight.exchange, vector, key, feedback
                )
            else:
                codes, residual = fused.encode(
                    codec,
                    flight.exchange,
                    vector,
                    flight.scale,
                    key,
                    feedback,
                    overwrite=flight.compensated,
                )
            if feedback:
                self.state.worker.propose(name, residual)
            start = flight.exchange.start_packed
        elif triton_fused.signs_apply(codec, vector):  # ef-sign's gradient buckets
            feedback = self.state.worker is not None
            codes, residual, _ = triton_fused.signs(codec, vector, flight.scale, feedback=feedback)
            if feedback:
                self.state.worker.propose(name, residual)
            start = flight.exchange.start_packed
        else:
            uniforms = self._uniforms(flight, key) if codec.stochastic else None
            codes = codec.encode(vector, flight.scale, uniforms)
            if self.state.worker is not None:
                sent = codec.decode(codec.values(codes), flight.scale, 1)
                self.state.worker.update(name, vector, sent)
            start = flight.exchange.start
        with self.meter.charging(name):
            flight.message = start(codes, flight.scale, codes_name(name))
        flight.stage = "codes"

    def _key(self, flight, rank):
        """The random stream of ``flight``'s draws: its tensor's ``stream_seed``, or a
        bucket's members' words (``BucketLayout.words``), each member's stream its own."""
        if flight.layout is None:
            return stream_seed(self.seed, rank, self.state.step, flight.plan.index)
        return flight.layout.words(
            [
                stream_seed(self.seed, rank, self.state.step, m.plan.index)
                for m in flight.layout.bucket.members
            ]
        )

    def _uniforms(self, flight, key):
        """The draws of ``flight``'s vector from its stream ``key`` (``_key``)."""
        if flight.layout is None:
            return seeding.uniforms(key, flight.vector.numel(), flight.vector.device)
        return flight.layout.uniforms(key)

    def synchronize(self, missing):
        """Finishes every exchange of this step and writes the results into ``.grad``.

        ``missing`` are parameters whose hook did not fire this step (unused in the forward
        pass): their zero gradients are exchanged too, because every rank must take part in
        the same collectives.
        """
        for param in missing:
            self.launch(param)
        self._start_ready_codes(block=True)
        for flight in self._in_flight.values():
            if flight.stage == "codes":
                with self.meter.charging(flight.plan.name), self._timed(flight.plan.name, "after"):
                    flight.message = flight.exchange.advance(flight.message)
        # param (a bucket's name) -> whether its gradient is finite, as its exchange knows
        known = {}
        for param, flight in self._in_flight.items():
            if flight.stage == "gather":  # a two-level shard that crossed no network
                continue
            if flight.stage == "plain":
                output = flight.result()
                if output.is_sparse:
                    param.grad = output
                elif output.data_ptr() != param.grad.data_ptr():  # float16, or flushed
                    with self._timed(flight.plan.name, "after"):
                        _write_grad(param, output.to(param.grad.dtype))
                continue
            name = flight.plan.name
            if flight.plan.exchange == TWO_LEVEL:
                with self.meter.charging(name), self._timed(name, "after"):
                    self._gather_shard(flight, flight.exchange.finish(flight.message))
                continue
            with self._timed(name, "after"):
                decoded = flight.exchange.finish(flight.message)
                if flight.layout is None:
                    _write_grad(param, decoded)
                else:
                    flight.decoded = decoded
                    members = self.buckets.params[name]
                    for member, part in zip(members, flight.layout.members(decoded)):
                        _write_grad(member, part)
            # A copy into another dtype could overflow: only an adopted result is known.
            if flight.exchange.finite is not None and (
                flight.layout is not None or param.grad.dtype == decoded.dtype
            ):
                known[param] = flight.exchange.finite
        for param, flight in self._in_flight.items():
            if flight.stage == "gather":
                gathered = flight.result()
                _write_grad(param, gathered[: flight.plan.numel])
        if self.state.committed():
            self.state.commit(all(known.values()) and self.all_finite(skip=known))
        self.last_sent_elements = {
            flight.plan.name: flight.exchange.sent_elements
            for flight in self._in_flight.values()
            if flight.exchange
        }
        for flight in self._in_flight.values():
            if flight.layout is not None:
                _share_bytes(self.meter.by_tensor, flight.layout.bucket)
        self._in_flight.clear()
        self._begun = False
        self.last_step_bytes, self.meter.bytes = self.meter.bytes, 0
        self.last_tensor_bytes, self.meter.by_tensor = self.meter.by_tensor, collections.Counter()
        self.state.step += 1
        if self.state.planner is not None:
            self._end_adaptive_step()

    def all_finite(self, skip=()):
        """Whether every exchanged gradient of this step, but those of ``skip``, is finite;
        the same answer on every rank, since they all hold the same averages. A bool where
        the CPU kernels run (the host holds the gradients and reads them without a torch
        op); elsewhere a boolean 0-d tensor on the gradients' device, never read in the step:
        the state commits by it with selects (``PipelineState.commit``), so a GPU step does
        not wait for its device."""
        grads = [
            flight.decoded
            if flight.layout is not None
            else p.grad.coalesce().values()
            if p.grad.is_sparse
            else p.grad
            for p, flight in self._in_flight.items()
            if p not in skip
        ]
        grads = [g for g in grads if g.numel() and g.is_floating_point()]
        # A tensor is finite iff its min and max are (both propagate NaN); aminmax is one
        # vectorized pass, ~15x cheaper on CPU than isfinite(g).all(). Small tensors
        # (biases, norms) share one op, the largest absolute value of each (NaN
        # propagates too), which is slower per element but not one op per tensor.
        small = [g for g in grads if g.numel() <= _SMALL_TENSOR]
        extremes = [torch.stack(torch.aminmax(g)) for g in grads if g.numel() > _SMALL_TENSOR]
        if small:
            extremes.append(torch.stack(torch._foreach_norm(small, float("inf"))))
        if not extremes:
            return True
        extremes = torch.cat(extremes)
        if fused.host_reads(extremes):
            return fused.finite(extremes.double())
        return torch.isfinite(extremes).all()

    # ----- accounting -----

    def _sent(self):
        """This step's tensors as ``hvd_compress.accounting`` counts them."""
        return [
            Sent(
                plan.name,
                plan.layer,
                plan.numel,
                param.element_size(),
                plan.route,
                plan.reason,
                self.last_tensor_bytes[plan.name],
                self.last_sent_elements.get(plan.name),
            )
            for param, plan in self.plans.items()
        ]

    def expected_bytes(self):
        """Bytes per step that the wire formats of ``hvd_compress.cost`` predict."""
        return accounting.expected_bytes(
            self.codec, self._sent(), self.world_size, cost.TORCH_ALLREDUCE_DTYPES, self.nodes
        )

    def compression_stats(self):
        """What the last step handed to Horovod, and how each tensor travels
        (``accounting.compression_stats``)."""
        return accounting.compression_stats(
            self.codec, self.state.step, self.last_step_bytes, self._sent()
        )
