"""Byte-count cost model of the exchanges, and the choice of exchange by ``"auto"``.

For a tensor of n elements on N workers, counted per worker and per step:

``handed``: bytes of the tensors this worker passes into Horovod collectives.
``sent``: bytes this worker puts on the network, for Horovod's ring algorithms:
    allreduce 2 (N - 1) / N x input, allgather (N - 1) x input, alltoall (N - 1) / N x input.

Exchanges (see ``hvd_compress.pt.exchange``):

``allreduce``: the codes in the narrowest allreduce carrier that cannot overflow for N
    workers (summable codecs only).
``allgather``: every worker's packed codes reach every worker, which sums them.
``sharded``: an alltoall sends shard k of every worker's packed codes to rank k, which sums
    them, packs the sum in the narrowest width that holds it, and an allgather returns every
    rank's summed shard to everyone. For a two-way codec (BlockSign) each shard also carries
    the worker's block scales, and rank k compresses its averaged shard again (its server
    scales travel with the allgather).

A codec with a shared scale adds one float32 per tensor to a Max-allreduce.

Sparse codecs: AdaComp's messages (``allgather``) differ in length from step to step, so their
traffic is that of an allgather of the message and of its int64 length
(``allgather_with_sizes_traffic``, given the message's bytes); CLT-k (``allreduce``) hands k
int32 indices to a broadcast from the step's leader and k float32 values to an allreduce.
"""

from dataclasses import dataclass

from .codes import ITEMSIZE, shard_length

EXCHANGES = ("allreduce", "allgather", "sharded")
# The exchange that sums inside each node uncompressed and compresses between nodes only
# (``hvd_compress.topology``): its compressed part among the nodes is one of the flat
# exchanges (``two_level_inner``).
TWO_LEVEL = "two-level"

# Collectives the PyTorch allreduce can sum (horovod.torch rejects int8 and uint8).
TORCH_ALLREDUCE_DTYPES = ("float16", "int32", "int64")
# The TensorFlow allreduce's: unlike horovod.torch, it also sums int8.
TF_ALLREDUCE_DTYPES = ("int8", "float16", "int32", "int64")


@dataclass(frozen=True)
class Traffic:
    handed: int
    sent: float
    collectives: int

    def __add__(self, other):
        return Traffic(
            self.handed + other.handed, self.sent + other.sent, self.collectives + other.collectives
        )


NO_TRAFFIC = Traffic(0, 0.0, 0)


def allreduce_traffic(nbytes, world_size):
    return Traffic(nbytes, 2 * (world_size - 1) / world_size * nbytes, 1)


def allgather_with_sizes_traffic(nbytes, world_size):
    """A payload of ``nbytes`` whose length differs between workers, and its int64 length,
    each allgathered."""
    return Traffic(nbytes + 8, (world_size - 1) * (nbytes + 8), 2)


def leader_allreduce_traffic(k, world_size):
    """k int32 indices broadcast by a leader that rotates over the workers (each sends them
    to the N - 1 others once every N steps), and k float32 values allreduced."""
    broadcast = Traffic(4 * k, 4 * k * (world_size - 1) / world_size, 1)
    return broadcast + allreduce_traffic(4 * k, world_size)


def top_k_traffic(k, world_size):
    """DGC's k int32 indices and k float32 values of one tensor, on two allgathers."""
    return Traffic(8 * k, (world_size - 1) * 8 * k, 2)


def low_rank_traffic(factor_elements, world_size):
    """PowerSGD's factors of one tensor, ``factor_elements`` = (n + m) r float32 values,
    in two allreduces (P, then Q)."""
    p_and_q = allreduce_traffic(4 * factor_elements, world_size)
    return Traffic(p_and_q.handed, p_and_q.sent, 2)


def uncompressed_traffic(numel, world_size, itemsize=4):
    """A tensor sent whole by a plain allreduce."""
    return allreduce_traffic(numel * itemsize, world_size)


def compressed_traffic(codec, numel, world_size, exchange, allreduce_dtypes=TORCH_ALLREDUCE_DTYPES):
    """Traffic of one tensor through ``codec`` and ``exchange``."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES} or 'auto', got {exchange!r}")
    if exchange not in exchanges_for(codec):
        raise ValueError(f"{codec.name} codes cannot be summed, so they cannot use {exchange}")
    if codec.sparse:
        if codec.message == "factors":
            raise ValueError(
                f"{codec.name} sends factors whose sizes follow a tensor's shape; "
                f"use low_rank_traffic with its factor_elements"
            )
        if not codec.summable:
            raise ValueError(
                f"{codec.name} messages differ in length from step to step; "
                f"use allgather_with_sizes_traffic with a message's bytes"
            )
        return leader_allreduce_traffic(codec.k(numel), world_size)
    scale_bytes = 4 * codec.buckets(numel) if codec.scaled else 0
    shared = codec.scaled and codec.shares_scale(exchange)
    scale = allreduce_traffic(scale_bytes, world_size) if shared else NO_TRAFFIC
    if exchange == "allreduce":
        carrier = codec.value_space.allreduce_carrier(world_size, allreduce_dtypes)
        return scale + allreduce_traffic(numel * ITEMSIZE[carrier], world_size)
    if exchange == "allgather":
        nbytes = codec.code_space.packed_nbytes(numel) + (0 if shared else scale_bytes)
        return scale + Traffic(nbytes, (world_size - 1) * nbytes, 1)
    phase1, phase2 = sharded_phases(codec, numel, world_size)
    sent = (world_size - 1) / world_size * phase1 + (world_size - 1) * phase2
    return scale + Traffic(phase1 + phase2, sent, 2)


def two_level_inner(codec, numel, cross_size, allreduce_dtypes=TORCH_ALLREDUCE_DTYPES):
    """The exchange among the nodes of a two-level exchange's shards of ``numel``
    elements: the one that ``codec`` can take and that sends the fewest bytes (on a tie,
    fewer collectives). From 3 to 8 nodes on, by codec, that is the sharded exchange: a
    node's link then carries about 2 shards' codes where an allgather carries M - 1."""
    candidates = exchanges_for(codec)

    def traffic(exchange):
        t = compressed_traffic(codec, numel, cross_size, exchange, allreduce_dtypes)
        return t.sent, t.collectives

    return min(candidates, key=traffic)


def two_level_traffic(
    codec,
    numel,
    local_size,
    cross_size,
    allreduce_dtypes=TORCH_ALLREDUCE_DTYPES,
    itemsize=4,
    node_allreduce=False,
):
    """Traffic of one tensor through the two-level exchange, on both tiers: the node's
    reduce-scatter of the zero-padded gradient (with ``node_allreduce`` an allreduce,
    ``topology.averages_by_allreduce``), the codec's exchange of the shard among the nodes
    (none on one node), the node's allgather of the decoded shards."""
    length = -(-numel // local_size)
    nbytes = length * itemsize
    inner = NO_TRAFFIC
    if cross_size > 1:
        exchange = two_level_inner(codec, length, cross_size, allreduce_dtypes)
        inner = compressed_traffic(codec, length, cross_size, exchange, allreduce_dtypes)
    if local_size == 1:
        return inner
    rounds = 2 if node_allreduce else 1  # a ring allreduce: reduce-scatter, then allgather
    scatter = Traffic(local_size * nbytes, rounds * (local_size - 1) * nbytes, 1)
    gather = Traffic(nbytes, (local_size - 1) * nbytes, 1)
    return scatter + inner + gather


def sharded_phases(codec, numel, world_size):
    """Bytes a worker hands to the sharded exchange's alltoall, then to its allgather."""
    if codec.two_way:
        # Each shard carries the worker's block scales; the server sends its own back.
        length = shard_length(numel, world_size, codec.code_space)
        phase1 = world_size * (4 * codec.buckets(numel) + codec.code_space.packed_nbytes(length))
        return phase1, 4 * codec.buckets(length) + codec.code_space.packed_nbytes(length)
    total = codec.value_space.summed(world_size)
    length = shard_length(numel, world_size, codec.code_space, total)
    return world_size * codec.code_space.packed_nbytes(length), total.packed_nbytes(length)


def alltoall_nbytes(codec, numel, world_size):
    """Bytes a worker hands to the alltoall of a tensor's ``sharded`` exchange."""
    return sharded_phases(codec, numel, world_size)[0]


def exchanges_for(codec):
    """The exchanges that can carry ``codec``'s codes."""
    if codec.sparse:
        return ("allreduce",) if codec.summable else ("allgather",)
    if codec.summable:
        return EXCHANGES
    return ("allgather", "sharded") if codec.two_way else ("allgather",)


# Horovod fuses the allreduces that are ready together into one collective, and the
# allgathers likewise, but runs every alltoall on its own, at a cost of a few round trips
# however small it is. On the benchmark's 2-core host at N = 4, the 76 alltoalls of
# ef-sign's sharded exchange of the 25M-parameter model took 438 ms to carry 192 ms of data
# at 100 Mbit/s: ~3 ms each, the time such a link takes for this many bytes. A faster
# link carries more bytes in the same latency, so there the charge is too low, never
# too high.
ALLTOALL_LATENCY_BYTES = 37_500

# The sharded exchanges of a step share alltoalls (``hvd_compress.fusion``) in groups that
# close once they carry this many bytes per worker: a group's one latency is then at most
# ~1/20 of its transfer time, while a 25M-parameter model's sign bits still make ~4 groups,
# the first of them ready long before the backward pass ends.
FUSION_BYTES = 20 * ALLTOALL_LATENCY_BYTES

# A two-way codec's allgather exchange runs its server on every rank over the whole tensor
# (the average of the workers' signs, the compensation, the scales, the second compression
# and its residual); the sharded exchange runs it once per shard, on the shard's rank. That
# pass takes 2-3 ns per element on one core of the benchmark's host with the fused kernels,
# the time the 100 Mbit/s link ``ALLTOALL_LATENCY_BYTES`` is counted on takes for 0.025-0.04
# bytes; the lower end is charged. At N = 2, where both exchanges send the same bytes, it
# decides: sharding the 25M-parameter model's large tensors shortens its ef-sign step (by
# more than the server's time at 1 Gbit/s and below: docs/design.md), while the CNN's small
# tensors would pay more in the alltoall's latency than their servers cost.
SERVER_BYTES_PER_ELEMENT = 0.025


def server_work_saved(codec, numel, world_size):
    """What the sharded exchange saves each rank of a two-way codec's server work on a
    tensor of ``numel`` elements against the allgather's replicated server, in bytes of
    ``SERVER_BYTES_PER_ELEMENT``."""
    if not codec.two_way:
        return 0.0
    return SERVER_BYTES_PER_ELEMENT * numel * (world_size - 1) / world_size


def choose_exchanges(codec, sizes, world_size, allreduce_dtypes=TORCH_ALLREDUCE_DTYPES):
    """The exchanges that cost a step the least time, for its compressed tensors of
    ``sizes`` elements (in that order): bytes sent, less the server work that a two-way
    codec's sharded exchange saves (``server_work_saved``), plus ``ALLTOALL_LATENCY_BYTES``
    for each fusion group of the sharded tensors' alltoalls (one per ``FUSION_BYTES`` they
    carry, at least one); on a tie, the exchange with fewer collectives.

    A tensor goes ``sharded`` only if that costs less than any other exchange, and those
    tensors go in order of what they save, as many as save the most after the latencies of
    their groups; the others take their next best exchange.
    """
    candidates = exchanges_for(codec)
    if len(candidates) == 1:
        return [candidates[0]] * len(sizes)

    def ranked(numel):
        traffic = {
            exchange: compressed_traffic(codec, numel, world_size, exchange, allreduce_dtypes)
            for exchange in candidates
        }
        charge = {exchange: traffic[exchange].sent for exchange in candidates}
        if "sharded" in charge:
            charge["sharded"] -= server_work_saved(codec, numel, world_size)
        return sorted(candidates, key=lambda e: (charge[e], traffic[e].collectives)), charge

    choices = [ranked(numel) for numel in sizes]
    # (bytes saved, index) of each tensor that sharded suits best, the largest saving first.
    savings = sorted(
        (
            (charge[order[1]] - charge["sharded"], index)
            for index, (order, charge) in enumerate(choices)
            if order[0] == "sharded"
        ),
        reverse=True,
    )
    best, best_net, saved, carried = 0, 0.0, 0.0, 0
    for count, (saving, index) in enumerate(savings, 1):
        saved += saving
        carried += alltoall_nbytes(codec, sizes[index], world_size)
        net = saved - ALLTOALL_LATENCY_BYTES * max(1, -(-carried // FUSION_BYTES))
        if net > best_net:
            best, best_net = count, net
    sharded = {index for _, index in savings[:best]}
    return [
        order[0] if index in sharded or order[0] != "sharded" else order[1]
        for index, (order, _) in enumerate(choices)
    ]
