"""How one tensor's codes cross the network, built only from Horovod collectives.

Every exchange delivers the same thing to every rank: the sum over workers of the codes (an
``int32`` tensor for integer codes, float32 for float codes). The codec decodes that sum.
Each exchange runs in up to three calls so that many tensors are in flight at once:
``start`` hands the first collective to Horovod, ``advance`` waits for it and hands over the
second one (sharded only), ``finish`` waits and returns the sum. The byte-count model of each
is in ``hvd_compress.cost``.
"""
import horovod.torch as hvd
import torch

from hvd_compress.codes import IntCodes, shard_length
from hvd_compress.cost import TORCH_ALLREDUCE_DTYPES

from .packing import pack, unpack


class Meter:
    """Counts the bytes of every tensor handed to a Horovod collective."""

    def __init__(self):
        self.bytes = 0

    def hand(self, tensor):
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor


def _sum_rows(rows):
    accumulate = torch.int32 if rows.dtype == torch.int32 else torch.float32
    return rows.sum(dim=0, dtype=accumulate)


class Allreduce:
    """Codes summed by one allreduce, in the narrowest carrier that cannot overflow."""

    name = "allreduce"

    def __init__(self, space, numel, world_size, meter):
        self.space, self.numel, self.meter = space, numel, meter
        self.carrier = getattr(torch, space.allreduce_carrier(world_size, TORCH_ALLREDUCE_DTYPES))

    def start(self, codes, name):
        payload = self.meter.hand(codes.to(self.carrier))
        return hvd.allreduce_async(payload, op=hvd.Sum, name=name)

    def advance(self, handle):
        return handle

    def finish(self, handle):
        total = hvd.synchronize(handle)
        return total.to(torch.int32 if isinstance(self.space, IntCodes) else torch.float32)


class Allgather:
    """Every worker's packed codes reach every worker, which unpacks and sums them."""

    name = "allgather"

    def __init__(self, space, numel, world_size, meter):
        self.space, self.numel, self.meter = space, numel, meter

    def start(self, codes, name):
        payload = self.meter.hand(pack(codes.reshape(1, -1), self.space))
        return hvd.allgather_async(payload, name=name)

    def advance(self, handle):
        return handle

    def finish(self, handle):
        rows = hvd.synchronize(handle)
        return _sum_rows(unpack(rows, self.space, self.numel))


class Sharded:
    """Reduce-scatter by alltoall, then allgather of the packed partial sums.

    Rank k receives shard k of every worker's codes, sums them and packs the sum in the
    narrowest width that holds it (``space.summed(world_size)``); an allgather returns all
    summed shards to everyone. Bytes per worker stay nearly flat as the world grows.
    """

    name = "sharded"

    def __init__(self, space, numel, world_size, meter):
        self.space, self.numel, self.meter = space, numel, meter
        self.world_size = world_size
        self.total_space = space.summed(world_size)
        self.length = shard_length(numel, world_size, space, self.total_space)

    def start(self, codes, name):
        flat = codes.reshape(-1)
        padded = flat.new_zeros(self.world_size * self.length)
        padded[: self.numel] = flat
        shards = pack(padded.reshape(self.world_size, self.length), self.space)
        return hvd.alltoall_async(self.meter.hand(shards), name=name), name

    def advance(self, pending):
        handle, name = pending
        received, _ = hvd.synchronize(handle)
        partial = _sum_rows(unpack(received, self.space, self.length))
        payload = self.meter.hand(pack(partial.reshape(1, -1), self.total_space))
        return hvd.allgather_async(payload, name=f"{name}.sum")

    def finish(self, handle):
        rows = hvd.synchronize(handle)
        total = unpack(rows, self.total_space, self.length).reshape(-1)[: self.numel]
        return total.to(torch.int32 if isinstance(self.space, IntCodes) else torch.float32)


EXCHANGES = {cls.name: cls for cls in (Allreduce, Allgather, Sharded)}
