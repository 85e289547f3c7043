"""The ways of averaging gradients that the benchmark compares, each as a ``Trainer``.

=================  =========================================================================
``hvd-none``       Horovod's own ``DistributedOptimizer``, uncompressed fp32 allreduce
``hvd-fp16``       the same with ``hvd.Compression.fp16``
``terngrad``       ``hvd_compress.pt.DistributedOptimizer``, TernGrad (paper defaults)
``qsgd-inf``       the same, QSGD with max-norm scaling, 4 bits, buckets of 512
``ef-sign``        the same, dist-EF-blockSGD's scaled sign with worker and server error
                   feedback (worker momentum, since the optimizer is SGD with momentum)
``<codec>-auto``   the same codec with ``adaptive=True``: each tensor by the codec, fp16 or
                   fp32, as the model of ``hvd_compress.adaptive`` predicts fastest
``<codec>-2l``     the same codec with ``exchange="two-level"``: summed uncompressed inside
                   a node, compressed between nodes (``bench --per-node L``)
``ddp``            PyTorch ``DistributedDataParallel`` over Gloo, fp32 allreduce
``ddp-fp16``       DDP with its ``fp16_compress_hook``
``dgc``            the same, DGC: top-k of the accumulated velocity (0.1%) over allgather
``powersgd``       ``hvd_compress.pt.DistributedOptimizer``, PowerSGD with the hook's rank and
                   start (its factors on Horovod's allreduce)
``ddp-powersgd``   DDP with its ``powerSGD_hook`` (rank 2, error feedback, warm start)
=================  =========================================================================

Every trainer takes the same SGD step on the same model and reports the bytes it handed to
the collectives in its last step (``handed``) and the bytes the cost model says a worker
puts on the network for them (``sent``, ``hvd_compress.cost``).
"""

import horovod.torch as hvd
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import hvd_compress.pt as hc
from hvd_compress import cost
from hvd_compress.cost import TWO_LEVEL
from hvd_compress.pt.topology import current_nodes
from hvd_compress.registry import resolve

from .protocol import TWO_LEVEL_SUFFIX, sent_bytes

MOMENTUM = 0.9
# PowerSGD (Vogels et al., NeurIPS 2019): rank r = 2 matched full-precision accuracy on
# ResNet-18/CIFAR-10 in the paper. torch's hook needs at least two uncompressed steps
# before it starts when error feedback is on; the warm-up steps cover them.
POWERSGD_RANK = 2
POWERSGD_START = 2


class Trainer:
    """One SGD step at a time with gradients averaged over all workers."""

    # Untimed steps before measuring: allocations, Horovod's response cache, and
    # PowerSGD's uncompressed start. A worker's heap grows for three steps (ef-sign's, at
    # N = 4: 123k, 67k and 20k fresh pages, then ~250 a step), and in this VM a fresh page
    # costs 13-16 us of CPU: a third step timed took 1.0-1.4 s against 0.8 s.
    warmup_steps = 3
    # Whether a new trainer warms up at every link rate (the adaptive mode decides for the
    # link it measured).
    per_rate = False

    def __init__(self, model, optimizer, world_size):
        self.model, self.optimizer, self.world_size = model, optimizer, world_size

    @property
    def module(self):
        """The trained network (without a DDP wrapper), for evaluation."""
        return self.model

    def step(self, inputs, targets):
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()

    def on_trial(self):
        """Whether the paths in force are on trial (the adaptive mode's): the steps that
        judge them are not those of the paths that stand."""
        return False

    def handed(self):
        """Bytes handed to the collectives in the last step, per worker."""
        raise NotImplementedError

    def sent(self):
        """Bytes a worker puts on the network per step for them (``hvd_compress.cost``)."""
        return cost.allreduce_traffic(self.handed(), self.world_size).sent


def sgd(model, lr):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)


def _gradient_bytes(model, itemsize):
    return sum(p.numel() for p in model.parameters()) * itemsize


class HorovodTrainer(Trainer):
    """``horovod.torch.DistributedOptimizer`` with one of Horovod's compressors."""

    def __init__(self, model, world_size, lr, compression):
        optimizer = hvd.DistributedOptimizer(
            sgd(model, lr), model.named_parameters(), compression=compression
        )
        super().__init__(model, optimizer, world_size)
        self.itemsize = 2 if compression is hvd.Compression.fp16 else 4

    def handed(self):
        return _gradient_bytes(self.model, self.itemsize)


class CodecTrainer(Trainer):
    """``hvd_compress.pt.DistributedOptimizer`` with a codec of the registry."""

    def __init__(self, model, world_size, lr, codec, adaptive=False, exchange="auto"):
        optimizer = hc.DistributedOptimizer(
            sgd(model, lr),
            model.named_parameters(),
            compression=codec,
            adaptive=adaptive,
            exchange=exchange,
        )
        super().__init__(model, optimizer, world_size)
        self.codec = resolve(codec, hc.CODECS)
        self.nodes = current_nodes() if exchange == TWO_LEVEL else None
        # Timed once the codec compresses: after PowerSGD's uncompressed start.
        self.warmup_steps = max(self.warmup_steps, self.codec.uncompressed_steps + 1)
        if adaptive:
            # The decision follows the adaptive warm-up; its trials run while ``on_trial``.
            self.warmup_steps = hc.Adaptive().warmup_steps + 1
            self.per_rate = True

    def on_trial(self):
        adaptive = self.optimizer.compression_stats().get("adaptive")
        return adaptive is not None and adaptive.get("judging", False)

    def handed(self):
        return self.optimizer.compression_stats()["bytes_handed"]

    def sent(self):
        return sent_bytes(
            self.codec,
            self.optimizer.compression_stats(),
            self.world_size,
            self.nodes,
            self.optimizer._hvdc_pipeline.node_allreduce,
        )


class DDPTrainer(Trainer):
    """PyTorch ``DistributedDataParallel`` over the default (Gloo) process group, with a
    communication hook (None: DDP's own fp32 allreduce)."""

    def __init__(self, model, world_size, lr, hook=None, state=None, itemsize=4):
        wrapped = DistributedDataParallel(model)
        if hook is not None:
            wrapped.register_comm_hook(state, hook)
        super().__init__(wrapped, sgd(model, lr), world_size)
        self.itemsize = itemsize

    @property
    def module(self):
        return self.model.module

    def handed(self):
        return _gradient_bytes(self.module, self.itemsize)


class PowerSGDTrainer(DDPTrainer):
    """DDP with PowerSGD; the bytes come from the hook's own count of the elements it
    allreduces (P and Q factors, and the tensors it leaves uncompressed)."""

    warmup_steps = POWERSGD_START + 1

    def __init__(self, model, world_size, lr):
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START,
        )
        super().__init__(model, world_size, lr, _one_bucket_at_a_time, self.state)
        self._counted = 0
        self._last = 0

    def step(self, inputs, targets):
        super().step(inputs, targets)
        total = self.state.total_numel_after_compression
        self._last, self._counted = total - self._counted, total

    def handed(self):
        if self.state.iter <= POWERSGD_START:
            return _gradient_bytes(self.module, 4)  # still allreducing whole gradients
        return 4 * self._last


def _one_bucket_at_a_time(state, bucket):
    """``powerSGD_hook``, finished before the next bucket's hook starts. Gloo matches
    collectives by the order each rank submits them, and the hook submits its Q allreduce from
    a callback of its P allreduce, which can come before or after the next bucket's P
    allreduce depending on thread timing: on the 25M-parameter model (several buckets) a rank
    received another collective's data and Gloo aborted. Waiting costs the overlap of a
    bucket's exchange with the rest of the backward pass, a small part of a step here."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


METHODS = {
    "hvd-none": lambda model, n, lr: HorovodTrainer(model, n, lr, hvd.Compression.none),
    "hvd-fp16": lambda model, n, lr: HorovodTrainer(model, n, lr, hvd.Compression.fp16),
    "terngrad": lambda model, n, lr: CodecTrainer(model, n, lr, "terngrad"),
    "qsgd-inf": lambda model, n, lr: CodecTrainer(model, n, lr, "qsgd-inf"),
    "ef-sign": lambda model, n, lr: CodecTrainer(model, n, lr, "ef-sign"),
    "dgc": lambda model, n, lr: CodecTrainer(model, n, lr, "dgc"),
    "powersgd": lambda model, n, lr: CodecTrainer(
        model, n, lr, f"powersgd:rank={POWERSGD_RANK}:start_iter={POWERSGD_START}"
    ),
    "terngrad-auto": lambda model, n, lr: CodecTrainer(model, n, lr, "terngrad", True),
    "qsgd-inf-auto": lambda model, n, lr: CodecTrainer(model, n, lr, "qsgd-inf", True),
    "ef-sign-auto": lambda model, n, lr: CodecTrainer(model, n, lr, "ef-sign", True),
    "terngrad-2l": lambda model, n, lr: CodecTrainer(model, n, lr, "terngrad", exchange=TWO_LEVEL),
    "qsgd-inf-2l": lambda model, n, lr: CodecTrainer(model, n, lr, "qsgd-inf", exchange=TWO_LEVEL),
    "ef-sign-2l": lambda model, n, lr: CodecTrainer(model, n, lr, "ef-sign", exchange=TWO_LEVEL),
    "ddp": lambda model, n, lr: DDPTrainer(model, n, lr),
    "ddp-fp16": lambda model, n, lr: DDPTrainer(
        model, n, lr, default_hooks.fp16_compress_hook, itemsize=2
    ),
    "ddp-powersgd": lambda model, n, lr: PowerSGDTrainer(model, n, lr),
}
# The accuracy run's uncompressed and peer methods; its other methods are the registry's codecs,
# each by its name alone (its defaults, as a user turns it on: ``accuracy_trainer``).
ACCURACY_BASELINES = ("hvd-none", "hvd-fp16", "ddp", "ddp-fp16", "ddp-powersgd")
ACCURACY_CODECS = tuple(name for name in hc.CODECS if name != "none")
ACCURACY_CHOICES = ACCURACY_BASELINES + ACCURACY_CODECS


def accuracy_trainer(method, model, world_size, lr):
    """The accuracy run's trainer of ``method`` (one of ``ACCURACY_CHOICES``)."""
    if method in ACCURACY_BASELINES:
        return METHODS[method](model, world_size, lr)
    return CodecTrainer(model, world_size, lr, method)


# The peers' codecs (DDP's PowerSGD, GRACE's and BytePS's top-k as DGC) in hvd_compress.
PEER_METHODS = ("powersgd", "dgc")
# The exchanges of hvd_compress, whose codec time the probe can separate from waiting.
CODEC_METHODS = (
    "terngrad",
    "qsgd-inf",
    "ef-sign",
    "powersgd",
    "terngrad-auto",
    "qsgd-inf-auto",
    "ef-sign-auto",
)


# The two-level exchanges, whose collectives run on process sets that Horovod's bare
# replay (``benchmarks.collectives.replay``) does not reproduce: timed as steps only.
TWO_LEVEL_METHODS = tuple(m for m in METHODS if m.endswith(TWO_LEVEL_SUFFIX))


def needs_ddp(methods):
    return any(name.startswith("ddp") for name in methods)


def needs_process_sets(methods):
    """Whether ``methods`` need ``hvd.init(process_sets="dynamic")``: the two-level
    exchanges add their node and shard sets at their first step."""
    return any(name in TWO_LEVEL_METHODS for name in methods)


def init_ddp():
    """Joins the Gloo process group of the DDP baselines (``MASTER_ADDR`` and
    ``MASTER_PORT`` come from the job, on rank 0's address)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
