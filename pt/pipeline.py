"""The per-step wiring of compressed gradient exchange: hook -> codec -> exchange -> decode.

``CompressionPipeline`` owns what happens to each gradient between the moment autograd has
produced it and the moment the wrapped optimizer reads it back. It is kept apart from the
optimizer class so that every wrapper (the optimizer, a local-SGD averager, tests) drives the
same code.
"""
import dataclasses

import horovod.torch as hvd
import torch

from hvd_compress import agreement, cost
from hvd_compress.seeding import stream_seed

from .exchange import Meter, ServerStep, make_exchange
from .memory import ErrorFeedback


@dataclasses.dataclass
class TensorPlan:
    """How one parameter's gradient travels; fixed at construction."""
    name: str
    index: int
    numel: int
    exchange: str  # "allreduce (uncompressed)" or the name of a compressed exchange
    reason: str    # why it is, or is not, compressed


@dataclasses.dataclass
class _InFlight:
    plan: TensorPlan
    param: torch.Tensor
    stage: str                 # "scale", "codes" or "plain"
    handle: object = None
    vector: torch.Tensor = None  # the flattened gradient, plus the worker residual
    scale: torch.Tensor = None
    exchange: object = None


UNCOMPRESSED = "allreduce (uncompressed)"


class CompressionPipeline:
    """Compressed averaging (or summing) of gradients across all Horovod ranks.

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
    """

    def __init__(self, named_parameters, codec, *, exchange="auto", average=True, seed=0,
                 uncompressed=(), prescale_factor=1.0, postscale_factor=1.0,
                 error_feedback=False):
        self.codec = codec
        self.worker_memory = ErrorFeedback() if error_feedback else None
        self.server_memory = ErrorFeedback() if codec.two_way else None
        # State changed by a step only if its exchanged gradients are all finite: objects
        # with ``commit(keep)``; wrappers add their own (worker momentum).
        self.step_state = [m for m in (self.worker_memory, self.server_memory) if m is not None]
        self.average = average
        self.seed = seed
        self.world_size = hvd.size()
        self.rank = hvd.rank()
        self.prescale_factor, self.postscale_factor = prescale_factor, postscale_factor
        self.step = 0
        self.meter = Meter()
        self.last_step_bytes = 0
        self._in_flight = {}
        uncompressed = set(uncompressed)
        self.plans = {}
        for index, (name, p) in enumerate(named_parameters):
            self.plans[p] = self._plan(name, index, p, exchange, name in uncompressed)
        problem = agreement.disagreement(hvd.allgather_object(agreement.describe(
            codec, exchange, average,
            [(plan.name, p.shape, p.dtype) for p, plan in self.plans.items()])))
        if problem:
            raise ValueError(problem)

    def _plan(self, name, index, param, exchange, whole):
        numel = param.numel()
        if whole:
            return TensorPlan(name, index, numel, UNCOMPRESSED, "excluded")
        if not param.is_floating_point():
            return TensorPlan(name, index, numel, UNCOMPRESSED, "not floating point")
        if self.codec.code_space is None:
            return TensorPlan(name, index, numel, UNCOMPRESSED, f"codec {self.codec.name}")
        if not self.codec.compresses(numel):
            return TensorPlan(name, index, numel, UNCOMPRESSED,
                              f"{numel} < min_size {self.codec.min_size}")
        if exchange == "auto":
            exchange = cost.choose_exchange(self.codec, numel, self.world_size)
        return TensorPlan(name, index, numel, exchange, "compressed")

    # ----- one step -----

    @property
    def in_flight(self):
        return bool(self._in_flight)

    def launch(self, param, ratio=1.0):
        """Starts the exchange of ``param.grad``; called once per parameter per step.
        ``ratio`` (eta_{t-1} / eta_t) rescales residuals kept in gradient units."""
        plan = self.plans[param]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        if plan.exchange == UNCOMPRESSED or grad.is_sparse:
            # Sparse gradients (sparse embeddings) go through Horovod's sparse allreduce
            # unless sparse_as_dense densified them.
            self._in_flight[param] = _InFlight(plan, param, "plain", self._launch_plain(plan, grad))
        else:
            flight = _InFlight(plan, param, "scale", vector=grad.reshape(-1))
            if self.worker_memory is not None:
                flight.vector = self.worker_memory.compensate(plan.name, flight.vector, ratio)
            server = None
            if self.codec.two_way:
                server = ServerStep(self.server_memory, plan.name, ratio)
            flight.exchange = make_exchange(
                plan.exchange, self.codec, plan.numel, self.world_size, self.meter,
                self.world_size if self.average else 1, server)
            if self.codec.scaled:
                flight.scale = self.codec.local_scale(flight.vector)
                if self.codec.shares_scale(plan.exchange):
                    flight.handle = hvd.allreduce_async(self.meter.hand(flight.scale), op=hvd.Max,
                                                        name=f"hvdc.{plan.name}.scale")
            self._in_flight[param] = flight
        self._start_ready_codes()

    def _launch_plain(self, plan, grad):
        name = f"hvdc.{plan.name}"
        op = hvd.Average if self.average else hvd.Sum
        if grad.is_sparse:
            return hvd.sparse_allreduce_async(grad, name=name, op=op)
        self.meter.hand(grad)
        return hvd.allreduce_async_(grad, name=name, op=op,
                                    prescale_factor=self.prescale_factor,
                                    postscale_factor=self.postscale_factor)

    def _start_ready_codes(self, wait=False):
        """Encodes and hands over the codes of every tensor whose shared scale has arrived."""
        for flight in self._in_flight.values():
            if flight.stage != "scale":
                continue
            if flight.handle is not None:
                if not wait and not hvd.poll(flight.handle):
                    continue
                flight.scale = hvd.synchronize(flight.handle)
            self._start_codes(flight)

    def _start_codes(self, flight):
        vector = flight.vector
        uniforms = None
        if self.codec.stochastic:
            generator = torch.Generator(device=vector.device)
            generator.manual_seed(stream_seed(self.seed, self.rank, self.step, flight.plan.index))
            uniforms = torch.rand(vector.shape, generator=generator, device=vector.device)
        codes = self.codec.encode(vector, flight.scale, uniforms)
        if self.worker_memory is not None:
            sent = self.codec.decode(self.codec.values(codes), flight.scale, 1)
            self.worker_memory.update(flight.plan.name, vector, sent)
        flight.handle = flight.exchange.start(codes, flight.scale,
                                              f"hvdc.{flight.plan.name}.codes")
        flight.stage = "codes"

    def synchronize(self, missing):
        """Finishes every exchange of this step and writes the results into ``.grad``.

        ``missing`` are parameters whose hook did not fire this step (unused in the forward
        pass): their zero gradients are exchanged too, because every rank must take part in
        the same collectives.
        """
        for param in missing:
            self.launch(param)
        self._start_ready_codes(wait=True)
        for flight in self._in_flight.values():
            if flight.stage == "codes":
                flight.handle = flight.exchange.advance(flight.handle)
        for param, flight in self._in_flight.items():
            if flight.stage == "plain":
                output = hvd.synchronize(flight.handle) if isinstance(flight.handle, int) \
                    else flight.handle()
                if output.is_sparse:
                    param.grad = output
                continue
            decoded = flight.exchange.finish(flight.handle)
            param.grad.copy_(decoded.reshape(param.grad.shape))
        if self.step_state:
            keep = self.all_finite()
            for state in self.step_state:
                state.commit(keep)
        self._in_flight.clear()
        self.last_step_bytes, self.meter.bytes = self.meter.bytes, 0
        self.step += 1

    def all_finite(self):
        """Whether every exchanged gradient of this step is finite; the same answer on
        every rank, since they all hold the same averages."""
        grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad
                 for p in self._in_flight]
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) \
            if grads else True

    # ----- state -----

    def state_dict(self):
        state = {"step": self.step}
        for role, memory in (("worker", self.worker_memory), ("server", self.server_memory)):
            if memory is not None:
                state[role] = memory.state_dict()
        return state

    def load_state_dict(self, state):
        self.step = int(state["step"])
        for role, memory in (("worker", self.worker_memory), ("server", self.server_memory)):
            if memory is not None and role in state:
                memory.load_state_dict(state[role])

    # ----- accounting -----

    def expected_bytes(self):
        """Bytes per step that the wire formats of ``hvd_compress.cost`` predict."""
        total = 0
        for param, plan in self.plans.items():
            if plan.exchange == UNCOMPRESSED:
                total += cost.uncompressed_traffic(plan.numel, self.world_size,
                                                   param.element_size()).handed
            else:
                total += cost.compressed_traffic(self.codec, plan.numel, self.world_size,
                                                 plan.exchange).handed
        return total

    def uncompressed_bytes(self):
        """Bytes per step that a plain allreduce of every gradient would hand over."""
        return sum(p.numel() * p.element_size() for p in self.plans)
