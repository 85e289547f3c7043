"""Gradient buckets: compressed tensors that travel alike, exchanged as one flat vector.

Off the CPU kernels every tensor operation is a kernel launch, and a codec makes a few
dozen of them per tensor (its scales, the draws, rounding, packing, the decode). A bucket
lays out the gradients of several tensors, in the order the backward pass produces them,
in one flat vector, and the codec runs over it once: its scales (one per tensor or per
block of a tensor) become segment reductions over the bucket, each member draws from its
own stream (``seeding``), so the codes, residuals and decoded averages are those of the
per-tensor exchanges, and the work and the collectives of a step grow with the number of
buckets instead of tensors (as Horovod's fusion buffer and DDP's buckets do for
allreduces).

In an allgather's bucket a member starts at a multiple of 8 elements (``ALIGNMENT``), so
that its codes begin on a byte of the packed message whatever the code width: the message
then holds the members' per-tensor codes side by side, byte for byte, and their scales
after them, as many bytes as their per-tensor messages. An allreduce's values need no
alignment. The sharded exchange cuts a bucket into the ranks' shards as it would one
tensor, so shards cross members; it pads the bucket to whole shards once rather than each
member, and sends no more bytes than the members would.

A two-way codec's server compresses its shard again, with blocks that end at the shard's
edges, so for it the sharded exchange cuts each member into the ranks' shards as that
member's own exchange would (``GradientBucket.shards``): each member's stretch is its
shards, rank k serves the k-th shard of every member (``shard_pieces``), and its server
blocks, codes and residuals are those of the members' own servers.
"""

from __future__ import annotations

import dataclasses

from .codes import shard_length
from .plan import TensorPlan

# Elements per gradient bucket's float32 vector at which it closes: DDP's default bucket
# (``bucket_cap_mb=25``).
BUCKET_BYTES = 25 * 2**20
# Elements a member's start is a multiple of, by the exchanges whose tensors share buckets
# (those that send every element): 8 codes fill whole bytes at every width.
ALIGNMENT = {"allreduce": 1, "allgather": 8, "sharded": 8}


@dataclasses.dataclass(frozen=True)
class Member:
    """A tensor of a bucket: its plan and where its elements start in the bucket."""

    plan: TensorPlan
    offset: int

    @property
    def stop(self) -> int:
        return self.offset + self.plan.numel


@dataclasses.dataclass
class GradientBucket:
    """Tensors whose gradients travel together (``members``, in the order their
    gradients arrive), all by ``exchange``; ``numel`` is the length of the bucket's vector,
    the members' elements and the padding after each (``stretch``). ``shards``: the ranks
    among which each member is sharded on its own (a two-way codec's sharded exchange),
    else 0."""

    name: str
    exchange: str
    members: list[Member]
    numel: int
    shards: int = 0

    @property
    def plan(self) -> TensorPlan:
        """The plan the pipeline sends the bucket by, as it would a tensor of its length."""
        return TensorPlan(self.name, -1, self.numel, self.exchange, "compressed", "bucket")

    def spans(self) -> list[tuple[int, int]]:
        """(start, length) of each member's stretch of the vector: its elements and the
        padding after them."""
        stops = [m.offset for m in self.members[1:]] + [self.numel]
        return [(m.offset, stop - m.offset) for m, stop in zip(self.members, stops)]

    def parts(self) -> list[tuple[int, int]]:
        """(elements, length of its stretch) of each member, for ``block_lengths``."""
        return [(m.plan.numel, length) for m, (_, length) in zip(self.members, self.spans())]

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of shard ``rank`` of a bucket whose members are sharded on their own
        (``shards``): the ``rank``-th shard of each member, in the members' order."""
        pieces, column = [], 0
        for member, (_, stretch) in zip(self.members, self.spans()):
            length = stretch // self.shards
            first = rank * length
            valid = max(0, min(length, member.plan.numel - first))
            pieces.append(ShardPiece(member, column, length, valid, first))
            column += length
        return pieces


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """A member's part of one shard of a bucket sharded member by member: ``length``
    elements from ``column`` of the shard's vector, the first ``valid`` of them the
    member's elements from its element ``first`` on, the rest padding."""

    member: Member
    column: int
    length: int
    valid: int
    first: int


def block_lengths(codec, parts: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The segments of a vector of ``parts`` (elements, length with their padding), laid
    end to end, for the codec's segment reductions, and which of them are blocks: each
    part's blocks (one scale each: ``codec.bucket_length`` elements, the last shorter),
    then its padding, which is no block's."""
    segments, blocks = [], []
    for numel, length in parts:
        d = codec.bucket_length(numel)
        for start in range(0, numel, d):
            blocks.append(len(segments))
            segments.append(min(d, numel - start))
        if length > numel:
            segments.append(length - numel)
    return segments, blocks


def _aligned(n: int, exchange: str) -> int:
    return -(-n // ALIGNMENT[exchange]) * ALIGNMENT[exchange]


def _member_shards(codec, exchange: str, world_size: int) -> int:
    """``GradientBucket.shards`` of ``codec``'s buckets on ``exchange``."""
    return world_size if exchange == "sharded" and codec.two_way else 0


def stretch(codec, exchange: str, numel: int, world_size: int) -> int:
    """Elements of a member's stretch of a bucket: its ``numel`` and the padding after
    them: to a multiple of ``ALIGNMENT``, or to its own whole shards (``GradientBucket.
    shards``)."""
    shards = _member_shards(codec, exchange, world_size)
    if shards:
        return shards * shard_length(numel, shards, codec.code_space)
    return _aligned(numel, exchange)


def gradient_buckets(
    plans: list[TensorPlan], codec, world_size: int, bucket_bytes: int = BUCKET_BYTES
) -> list[GradientBucket]:
    """The buckets of the compressed tensors of ``plans`` (in the parameters' order, the
    same on every rank) whose exchange among ``world_size`` ranks sends every element:
    filled in the order the backward pass produces gradients (the parameters' reversed),
    one exchange at a time, each closed once its float32 vector holds ``bucket_bytes``. A
    bucket of one tensor is none: that tensor goes alone, as it would. ``bucket_bytes`` 0
    makes no buckets."""
    if bucket_bytes <= 0 or not codec.bucketable:
        return []
    open_members, buckets = {}, []

    def end(members, exchange):
        last = members[-1]
        return last.offset + stretch(codec, exchange, last.plan.numel, world_size)

    def close(exchange):
        members = open_members.pop(exchange)
        if len(members) > 1:
            name = f"bucket.{exchange}.{len(buckets)}"
            shards = _member_shards(codec, exchange, world_size)
            buckets.append(GradientBucket(name, exchange, members, end(members, exchange), shards))

    for plan in reversed(plans):
        exchange = plan.exchange
        if plan.reason != "compressed" or exchange not in ALIGNMENT:
            continue
        members = open_members.setdefault(exchange, [])
        offset = end(members, exchange) if members else 0
        members.append(Member(plan, offset))
        if 4 * (offset + plan.numel) >= bucket_bytes:
            close(exchange)
    for exchange in list(open_members):
        close(exchange)
    return buckets
