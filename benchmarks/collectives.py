"""What a training step asks of Horovod, observed from outside the code being measured, and
the same collectives replayed bare (no encode, no decode): the ceiling a codec can approach.

``HorovodProbe`` wraps the entry points of ``horovod.torch`` that ``hvd_compress.pt``
calls through the module (``hvd.allgather_async(...)``), for the duration of a ``with``
block: it records every collective (kind, shape, dtype, op) and adds up the time the
caller spends blocked in ``hvd_compress.pt.exchange.wait`` (the pipeline's only way of
waiting for a collective), so that a step's time splits into compute, waiting for the
network, and the codec's own work.
"""

import dataclasses
import math
import time

import horovod.torch as hvd
import torch

from hvd_compress import cost
from hvd_compress.pt import exchange, fusion, pipeline
from hvd_compress.pt.exchange import wait

COLLECTIVES = ("allreduce_async", "allreduce_async_", "allgather_async", "alltoall_async")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVES
    name: str  # Horovod matches the ranks' requests by name, not by order
    shape: tuple
    dtype: torch.dtype
    op: object = None  # the reduction of an allreduce (hvd.Sum, hvd.Max, ...)

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize

    def sent(self, world_size):
        """Bytes a worker puts on the network for it, by the ring model of
        ``hvd_compress.cost``."""
        if self.kind.startswith("allreduce"):
            return cost.allreduce_traffic(self.nbytes, world_size).sent
        if self.kind == "allgather_async":
            return (world_size - 1) * self.nbytes
        return (world_size - 1) / world_size * self.nbytes


class HorovodProbe:
    """Records the collectives handed to Horovod and the time spent waiting for them."""

    def __init__(self):
        self.collectives = []
        self.wait_seconds = 0.0
        self._originals = {}

    def __enter__(self):
        for kind in COLLECTIVES:
            self._replace(hvd, kind, self._recording(kind, getattr(hvd, kind)))
        for module in (exchange, fusion, pipeline):
            self._replace(module, "wait", self._timed(wait))
        return self

    def __exit__(self, *exc):
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def _replace(self, module, name, replacement):
        self._originals[module, name] = getattr(module, name)
        setattr(module, name, replacement)

    def _recording(self, kind, original):
        def record(tensor, *args, **kwargs):
            self.collectives.append(
                Collective(
                    kind, kwargs["name"], tuple(tensor.shape), tensor.dtype, kwargs.get("op")
                )
            )
            return original(tensor, *args, **kwargs)

        return record

    def _timed(self, original):
        def timed_wait(handle):
            start = time.perf_counter()
            try:
                return original(handle)
            finally:
                self.wait_seconds += time.perf_counter() - start

        return timed_wait


def replay(collectives, tag):
    """Hands ``collectives`` (zero tensors of the recorded shapes) to Horovod all at once and
    waits for them; returns the seconds taken. ``tag`` keeps the names apart from those of
    training and of other replays; each rank may have recorded its collectives in another
    order, which the names make irrelevant."""
    tensors = [torch.zeros(c.shape, dtype=c.dtype) for c in collectives]
    start = time.perf_counter()
    handles = []
    for collective, tensor in zip(collectives, tensors):
        name = f"bare.{tag}.{collective.name}"
        if collective.kind.startswith("allreduce"):
            handles.append(hvd.allreduce_async_(tensor, name=name, op=collective.op or hvd.Sum))
        elif collective.kind == "allgather_async":
            handles.append(hvd.allgather_async(tensor, name=name))
        else:
            handles.append(hvd.alltoall_async(tensor, name=name))
    for handle in handles:
        wait(handle)
    return time.perf_counter() - start


def allreduce_of(model, dtype):
    """Horovod's uncompressed exchange: one allreduce per gradient, in ``dtype``."""
    return [
        Collective("allreduce_async_", name, tuple(p.shape), dtype, hvd.Sum)
        for name, p in model.named_parameters()
    ]


def reference_ceilings(numel, world_size):
    """The reference bare exchanges of a whole model's ``numel`` gradient elements: a 2-bit
    payload by allgather, and a 1-bit payload by alltoall of shards plus allgather of the
    (1-bit) summed shards."""
    one_bit_shard = math.ceil(numel / 8 / world_size)
    return {
        "2-bit allgather": [
            Collective("allgather_async", "codes", (1, math.ceil(numel / 4)), torch.uint8)
        ],
        "1-bit alltoall+allgather": [
            Collective("alltoall_async", "shards", (world_size, one_bit_shard), torch.uint8),
            Collective("allgather_async", "sums", (1, one_bit_shard), torch.uint8),
        ],
    }
