"""Exchange time on a cluster of M nodes of L workers: Horovod's collectives charged per
tier by their message rounds and their bytes, for sizes no test machine runs.

Each tier is a link with a latency alpha (seconds per message round) and a bandwidth B
(``Tier``): inside a node (NVLink, PCIe, shared memory) and between nodes (the network).
A collective among n ranks takes ``rounds x alpha + 8 x bytes / B``, where ``bytes`` is
what the busiest link carries:

``allreduce``  Horovod's ring: 2 (n - 1) rounds; each link carries 2 (n - 1) / n of the
               input.
``allgather``  the ring: n - 1 rounds; each link carries (n - 1) inputs.
``alltoall``   pairwise: n - 1 rounds; a node's link carries what its L ranks send to the
               other nodes' ranks, L (n - L) / n of an input each.

On M > 1 nodes a flat ring runs at the pace of the links between nodes (placed node by
node, it crosses each node's link once each way), so the flat exchanges are charged on
that tier. The two-level exchange (``cost.TWO_LEVEL``) is a reduce-scatter and an allgather
of the fp32 gradient among a node's L ranks on the inside tier, and between them the
codec's exchange of a 1/L shard among the M nodes, L of which (one per local rank) share
each node's link. Horovod's hierarchical allreduce (NCCL) is the same with an fp32
allreduce of the shard.

Horovod fuses allreduces and allgathers into buffers of up to ``HOROVOD_FUSION_BYTES`` (its
``HOROVOD_FUSION_THRESHOLD``), and the pipeline groups the sharded exchanges' alltoalls up to
``cost.FUSION_BYTES`` (``hvd_compress.fusion``), so a step's rounds are charged per buffer or
group, not per tensor.
The codecs' own passes over memory are charged by the bytes they read and write
(``codec_bytes_per_element``) at the device's memory bandwidth: a GPU runs them as
elementwise kernels bound by memory. What the model leaves out: the CPU time of Gloo's sums
(on GPUs NCCL sums at memory speed) and contention between collectives of different kinds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from . import cost
from .codes import ITEMSIZE

HOROVOD_FUSION_BYTES = 64 << 20
# The paths that send tensors whole.
FP32, FP16, HIERARCHICAL = "fp32 allreduce", "fp16 allreduce", "hierarchical fp32"
WHOLE_PATHS = (FP32, FP16, HIERARCHICAL)


@dataclasses.dataclass(frozen=True)
class Tier:
    """A tier's links: ``latency`` alpha, seconds per message round, and
    ``bits_per_second`` B each way."""

    latency: float
    bits_per_second: float

    def seconds(self, rounds: float, nbytes: float) -> float:
        """``rounds`` message rounds and ``nbytes`` on the busiest link."""
        return rounds * self.latency + 8 * nbytes / self.bits_per_second


@dataclasses.dataclass(frozen=True)
class Cluster:
    """M = ``nodes`` of L = ``per_node`` workers, joined ``inside`` a node and
    ``between`` nodes."""

    nodes: int
    per_node: int
    inside: Tier
    between: Tier

    @property
    def workers(self) -> int:
        return self.nodes * self.per_node

    @property
    def flat_tier(self) -> Tier:
        """The tier a ring over all workers waits for."""
        return self.between if self.nodes > 1 else self.inside


def _buffers(nbytes: float, fused: int = HOROVOD_FUSION_BYTES) -> int:
    return max(1, math.ceil(nbytes / fused)) if nbytes else 0


def allreduce(tier: Tier, size: int, nbytes: float, sharing: int = 1) -> float:
    """A ring allreduce of ``nbytes`` per rank among ``size`` ranks, ``sharing`` rings on
    each link."""
    if size == 1 or not nbytes:
        return 0.0
    return tier.seconds(2 * (size - 1) * _buffers(nbytes), sharing * 2 * (size - 1) / size * nbytes)


def allgather(tier: Tier, size: int, nbytes: float, sharing: int = 1) -> float:
    """A ring allgather of ``nbytes`` from each of ``size`` ranks."""
    if size == 1 or not nbytes:
        return 0.0
    return tier.seconds((size - 1) * _buffers(nbytes), sharing * (size - 1) * nbytes)


def alltoall(tier: Tier, size: int, nbytes: float, senders: int = 1, neighbours: int = 1) -> float:
    """A pairwise alltoall of ``nbytes`` from each of ``size`` ranks: ``senders`` ranks
    (of this alltoall or of concurrent ones) send through each link, each to all but the
    ``neighbours`` ranks of the alltoall on its own node (itself included)."""
    if size == 1 or not nbytes:
        return 0.0
    crossing = senders * (size - neighbours) / size * nbytes
    return tier.seconds((size - 1) * _buffers(nbytes, cost.FUSION_BYTES), crossing)


@dataclasses.dataclass
class _Step:
    """A step's bytes per rank by collective kind, each kind fused across tensors."""

    allreduce: float = 0.0
    allgather: float = 0.0
    alltoall: float = 0.0

    def add(self, kind: str, nbytes: float) -> None:
        setattr(self, kind, getattr(self, kind) + nbytes)


def _codec_collectives(codec, numel: int, size: int, exchange: str, step: _Step) -> None:
    """The bytes one rank hands each collective for a tensor of ``numel`` elements through
    ``codec`` and a flat ``exchange`` among ``size`` ranks (``cost.compressed_traffic``'s
    wire formats)."""
    scale_bytes = 4 * codec.buckets(numel) if codec.scaled else 0
    shared = codec.scaled and codec.shares_scale(exchange)
    if shared:
        step.add("allreduce", scale_bytes)
    if exchange == "allreduce":
        carrier = codec.value_space.allreduce_carrier(size, cost.TORCH_ALLREDUCE_DTYPES)
        step.add("allreduce", numel * ITEMSIZE[carrier])
    elif exchange == "allgather":
        own_scale = 0 if shared else scale_bytes
        step.add("allgather", codec.code_space.packed_nbytes(numel) + own_scale)
    else:
        phase1, phase2 = cost.sharded_phases(codec, numel, size)
        step.add("alltoall", phase1)
        step.add("allgather", phase2)


def _flat_seconds(step: _Step, tier: Tier, size: int, per_node: int, neighbours: int) -> float:
    """``step``'s collectives among ``size`` ranks, ``per_node`` of which (or of concurrent
    collectives' ranks) share each node's link, ``neighbours`` of which share a node. A
    ring over ranks on several nodes crosses each node's link once each way."""
    rings = per_node // neighbours
    return (
        allreduce(tier, size, step.allreduce, rings)
        + allgather(tier, size, step.allgather, rings)
        + alltoall(tier, size, step.alltoall, per_node, neighbours)
    )


def whole_seconds(cluster: Cluster, numel: int, path: str) -> float:
    """Seconds to exchange ``numel`` gradient elements sent whole on ``path``
    (``WHOLE_PATHS``)."""
    n, big = cluster.workers, cluster.flat_tier
    if path == FP32:
        return allreduce(big, n, 4 * numel)
    if path == FP16:
        return allreduce(big, n, 2 * numel)
    inside = allreduce(cluster.inside, cluster.per_node, 4 * numel)  # reduce-scatter + allgather
    shard = 4 * numel / cluster.per_node
    return inside + allreduce(cluster.between, cluster.nodes, shard, cluster.per_node)


def exchange_seconds(
    codec,
    compressed: Sequence[int],
    whole: int,
    cluster: Cluster,
    exchange: str,
    node_allreduce: bool = False,
) -> float:
    """Seconds of a step's exchange: the ``compressed`` tensors' sizes through ``codec``
    and ``exchange`` (a flat one; ``"auto"``, each tensor's by ``cost.choose_exchanges``;
    or ``cost.TWO_LEVEL``), and ``whole`` elements the codec leaves to Horovod's fp32
    allreduce. ``node_allreduce``: a two-level node averages by an allreduce of which each
    rank keeps its shard, as for CPU tensors (``topology.averages_by_allreduce``), rather
    than by a reduce-scatter."""
    rest = whole_seconds(cluster, whole, FP32)
    n, m, local = cluster.workers, cluster.nodes, cluster.per_node
    step = _Step()
    if exchange != cost.TWO_LEVEL:
        routes = (
            cost.choose_exchanges(codec, compressed, n)
            if exchange == "auto"
            else [exchange] * len(compressed)
        )
        for numel, route in zip(compressed, routes):
            _codec_collectives(codec, numel, n, route, step)
        # On one node each rank has a link of its own on the inside tier.
        per_node = local if m > 1 else 1
        return rest + _flat_seconds(step, cluster.flat_tier, n, per_node, per_node)
    padded = 0
    for numel in compressed:
        length = -(-numel // local)
        padded += length * local
        if m > 1:
            inner = cost.two_level_inner(codec, length, m)
            _codec_collectives(codec, length, m, inner, step)
    # The node's reduce-scatter and allgather of the padded fp32 gradient: one ring
    # allreduce's rounds and bytes; for an allreduce in place of the reduce-scatter, that
    # allreduce and the allgather.
    inside = allreduce(cluster.inside, local, 4 * padded)
    if node_allreduce:
        inside += allgather(cluster.inside, local, 4 * padded / local)
    return rest + inside + _flat_seconds(step, cluster.between, m, local, 1)


def codec_bytes_per_element(codec, exchange: str, size: int) -> float:
    """Bytes of memory a rank's codec passes read and write per gradient element: the
    encoding reads the gradient and writes its codes (with error feedback it also reads
    and rewrites the residual); the decoding reads what arrived (every rank's codes, after
    an allgather) and writes the gradient. A lower bound: fused kernels at memory speed."""
    code = codec.code_space.width / 8
    encode = 4 + code + (8 if codec.error_feedback_default else 0)
    if exchange == "allgather":
        arrived = size * code
    elif exchange == "allreduce":
        arrived = ITEMSIZE[codec.value_space.allreduce_carrier(size, cost.TORCH_ALLREDUCE_DTYPES)]
    elif codec.two_way:  # a shard of every rank's signs, then every server's signs
        arrived = 2 * code
    else:  # a shard of every rank's codes, then every rank's summed shard, widened
        arrived = code + codec.value_space.summed(size).width / 8
    return encode + arrived + 4
