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
"""

from __future__ import annotations

import dataclasses

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
    the members' elements and the padding that aligns each (``ALIGNMENT``)."""

    name: str
    exchange: str
    members: list[Member]
    numel: int

    @property
    def plan(self) -> TensorPlan:
        """The plan the pipeline sends the bucket by, as it would a tensor of its length."""
        return TensorPlan(self.name, -1, self.numel, self.exchange, "compressed", "bucket")

    def spans(self) -> list[tuple[int, int]]:
        """(start, length) of each member's stretch of the vector: its elements and the
        padding after them."""
        stops = [m.offset for m in self.members[1:]] + [self.numel]
        return [(m.offset, stop - m.offset) for m, stop in zip(self.members, stops)]

    def block_lengths(self, codec) -> tuple[list[int], list[int]]:
        """The segments of the vector for the codec's segment reductions, and which of them
        are blocks: each member's blocks (one scale each: ``codec.bucket_length`` elements,
        the last shorter), then its padding, which is no block's."""
        segments, blocks = [], []
        for member, (_, length) in zip(self.members, self.spans()):
            numel = member.plan.numel
            d = codec.bucket_length(numel)
            for start in range(0, numel, d):
                blocks.append(len(segments))
                segments.append(min(d, numel - start))
            if length > numel:
                segments.append(length - numel)
        return segments, blocks


def _aligned(n: int, exchange: str) -> int:
    return -(-n // ALIGNMENT[exchange]) * ALIGNMENT[exchange]


def gradient_buckets(
    plans: list[TensorPlan], codec, bucket_bytes: int = BUCKET_BYTES
) -> list[GradientBucket]:
    """The buckets of the compressed tensors of ``plans`` (in the parameters' order, the
    same on every rank) whose exchange sends every element: filled in the order the
    backward pass produces gradients (the parameters' reversed), one exchange at a time,
    each closed once its float32 vector holds ``bucket_bytes``. A bucket of one tensor is
    none: that tensor goes alone, as it would. ``bucket_bytes`` 0 makes no buckets."""
    if bucket_bytes <= 0 or not codec.bucketable:
        return []
    open_members, buckets = {}, []

    def close(exchange):
        members = open_members.pop(exchange)
        if len(members) > 1:
            name = f"bucket.{exchange}.{len(buckets)}"
            numel = _aligned(members[-1].stop, exchange)
            buckets.append(GradientBucket(name, exchange, members, numel))

    for plan in reversed(plans):
        exchange = plan.exchange
        if plan.reason != "compressed" or exchange not in ALIGNMENT:
            continue
        members = open_members.setdefault(exchange, [])
        offset = _aligned(members[-1].stop, exchange) if members else 0
        members.append(Member(plan, offset))
        if 4 * (offset + plan.numel) >= bucket_bytes:
            close(exchange)
    for exchange in list(open_members):
        close(exchange)
    return buckets
