"""Gradient buckets (``hvd_compress.bucketing``) in a PyTorch pipeline: which buckets carry a
step's gradients (``GradientBuckets``), each laid out on its device (``BucketLayout``: the
vector its members' gradients are copied into, the segments its codec reduces over, its
members' draws), and the moves of their residuals between their own names and the
bucket's."""

from __future__ import annotations

import copy
import functools

import torch

from hvd_compress.bucketing import GradientBucket, block_lengths, gradient_buckets
from hvd_compress.seeding import key_words

from . import fused
from .buckets import Segments
from .seeding import stream_uniforms


def _indices(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _segments(codec, parts: list[tuple[int, int]], device: torch.device) -> Segments:
    """The ``Segments`` of ``codec``'s blocks over a vector of ``parts`` (elements, length
    with their padding) laid end to end (``hvd_compress.bucketing.block_lengths``)."""
    lengths, blocks = block_lengths(codec, parts)
    groups, members, first_block, offset = [], [], 0, 0
    for numel, length in parts:
        groups.append(codec.buckets(numel))
        members.append((offset, numel, length, first_block, codec.bucket_length(numel)))
        first_block += groups[-1]
        offset += length
    return Segments(lengths, blocks, groups, members, device)


def _blocked(codec, segments: Segments):
    """A copy of ``codec`` whose blocks are ``segments``: it codes their vector as it would
    one tensor."""
    codec = copy.copy(codec)
    codec.bucket_length = lambda numel: segments
    codec.buckets = lambda numel: segments.count
    return codec


class BucketLayout:
    """``bucket`` laid out on ``device`` for ``codec``.

    Attributes:
        vector: the bucket's float32 gradients, each member's copied in as it arrives
            (``put``); the padding stays zero.
        codec: a copy of ``codec`` whose blocks are the bucket's ``segments``: the
            pipeline codes the vector with it as it would one tensor.
        shards: for a bucket sharded member by member, its ``ShardLayout`` seen from
            ``rank``; else None.
    """

    def __init__(self, bucket: GradientBucket, codec, device: torch.device, rank: int):
        self.bucket = bucket
        self.device = device
        spans = bucket.spans()
        self.segments = _segments(codec, bucket.parts(), device)
        self.codec = _blocked(codec, self.segments)
        self.shards = ShardLayout(bucket, codec, rank, device) if bucket.shards else None
        self._span_lengths = [length for _, length in spans]
        self._spans = _indices(self._span_lengths, device)
        # Made when first needed, each by one path only: each element's counter in its
        # member's stream (the eager draws), the member views of ``Segments.decoded``
        # (Triton's decodes).
        self._counters = self._decoded = None
        self.vector = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
        self._views = self._shaped(self.vector)

    def _shaped(self, vector):
        return [vector[m.offset : m.stop].view(m.plan.shape) for m in self.bucket.members]

    def put(self, index: int, grad: torch.Tensor) -> None:
        """Copies member ``index``'s gradient into the vector."""
        self._views[index].copy_(grad)

    def words(self, keys: list[int]) -> torch.Tensor:
        """The ``key_words`` (lo, multiplier) of each member's stream ``keys[i]`` (a
        ``stream_seed``), one row each, on the device."""
        return _indices([key_words(key) for key in keys], self.device)

    def uniforms(self, words: torch.Tensor) -> torch.Tensor:
        """The draws of the vector: each member's from its stream (``words``), as its own
        tensor would draw them."""
        numel = self.bucket.numel
        if self._counters is None:  # an element's index within its member
            starts = _indices([start for start, _ in self.bucket.spans()], self.device)
            self._counters = torch.arange(numel, device=self.device) - torch.repeat_interleave(
                starts, self._spans, output_size=numel
            )
        lo, multiplier = (
            torch.repeat_interleave(w, self._spans, output_size=numel) for w in words.unbind(1)
        )
        return stream_uniforms(self._counters, lo, multiplier)

    def server_lr_ratio(self, lr_ratio):
        """The learning-rate ratio of this rank's server from the bucket's (``lr_ratios``): where
        it is one per element and the bucket is sharded member by member, those of this
        rank's shard."""
        if self.shards is None or not isinstance(lr_ratio, torch.Tensor) or lr_ratio.dim() == 0:
            return lr_ratio
        return lr_ratio.index_select(0, self.shards.own)

    def members(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Each member's part of a bucket-long ``vector``: in its shape where ``vector`` is
        where the kernels decode (views made once), else flat."""
        if vector is self.segments.decoded:
            if self._decoded is None:
                self._decoded = self._shaped(vector)
            return self._decoded
        parts = vector.split(self._span_lengths)
        return [
            part if part.numel() == m.plan.numel else part[: m.plan.numel]
            for part, m in zip(parts, self.bucket.members)
        ]

    def lr_ratios(self, lr_ratios: list):
        """One learning-rate ratio for the vector from its members' (``launch``): theirs if
        they are all one value, else each member's over its elements."""
        first = lr_ratios[0]
        if all(r is first or (not isinstance(r, torch.Tensor) and r == first) for r in lr_ratios):
            return first
        per_member = torch.stack(
            [torch.as_tensor(r, dtype=torch.float32, device=self.device) for r in lr_ratios]
        )
        return torch.repeat_interleave(per_member, self._spans, output_size=self.bucket.numel)


class ShardLayout:
    """A bucket sharded member by member (``GradientBucket.shards``) on ``device``, as
    ``rank`` sees it: shard r is the r-th shard of every member (``shard_pieces``), each
    shard's server blocks are those its members' own servers would cut
    (``hvd_compress.bucketing``), and each server's block scales travel in a head with
    as many slots per member as its own exchange's.

    Attributes:
        length: elements of a shard.
        head: server block scales in a server's head.
        server_codec: a copy of the codec whose blocks are this rank's server blocks.
    """

    def __init__(self, bucket: GradientBucket, codec, rank: int, device: torch.device):
        shards = [bucket.shard_pieces(r) for r in range(bucket.shards)]
        self.shards = bucket.shards
        self.length = sum(piece.length for piece in shards[0])
        self._shards, self._rank, self._device = shards, rank, device
        per_byte = codec.code_space.codes_per_byte
        self._byte_order = _int32(self._order()[::per_byte] // per_byte, device)
        self.server_codec = _blocked(
            codec, _segments(codec, [(p.valid, p.length) for p in shards[rank]], device)
        )
        # Where each member's server scales start in a head, and its worker blocks start
        # among the bucket's.
        slots, first_blocks = [0], [0]
        for piece in shards[0]:
            slots.append(slots[-1] + codec.buckets(piece.length))
            first_blocks.append(first_blocks[-1] + codec.buckets(piece.member.plan.numel))
        self.head = slots[-1]
        worker_blocks, server_blocks, head_slots = [], [], []
        for r, pieces in enumerate(shards):
            for i, p in enumerate(pieces):
                elements = torch.arange(p.first, p.first + p.valid)
                padding = torch.full((p.length - p.valid,), -1)
                if r == rank:
                    d = codec.bucket_length(p.member.plan.numel)
                    worker_blocks += [first_blocks[i] + elements // d, padding]
                    head_slots.append(slots[i] + torch.arange(codec.buckets(p.valid)))
                d = codec.bucket_length(p.valid)
                server_blocks += [r * self.head + slots[i] + (elements - p.first) // d, padding]
        # The block of each element of this rank's shard among a worker's blocks, of each
        # element of every shard among the servers' heads laid end to end; -1 for
        # padding, which takes the zero appended to the scales (``_scaled_signs``).
        # Attributes, as Triton's kernels read them too (``triton_fused``).
        self.worker_blocks = _int32(torch.cat(worker_blocks), device)
        self.server_blocks = _int32(torch.cat(server_blocks), device)
        self._head_slots = torch.cat(head_slots).to(device)

    def _order(self) -> torch.Tensor:
        """The bucket's element at each position of the shards laid end to end (int64, on
        the CPU)."""
        return torch.cat(
            [
                torch.arange(p.member.offset + p.first, p.member.offset + p.first + p.length)
                for pieces in self._shards
                for p in pieces
            ]
        )

    # Each path's index of the bucket's elements, made when first needed: on the device
    # the kernels scatter the shards' elements to the bucket (``order``), the eager ops
    # gather them (``_inverse``); ``own`` only serves a per-element learning-rate ratio.

    @functools.cached_property
    def order(self) -> torch.Tensor:
        return _int32(self._order(), self._device)

    @functools.cached_property
    def _inverse(self) -> torch.Tensor:
        return _int32(torch.argsort(self._order()), self._device)

    @functools.cached_property
    def own(self) -> torch.Tensor:
        """The bucket's elements of this rank's shard, in its order."""
        first = self._rank * self.length
        return _int32(self._order()[first : first + self.length], self._device)

    def rows(self, packed: torch.Tensor) -> torch.Tensor:
        """The bucket's packed codes as one row per shard."""
        return packed.index_select(0, self._byte_order).view(self.shards, -1)

    def worker_average(self, signs: torch.Tensor, scales: torch.Tensor, count: int):
        """The average over the workers of their signs of this rank's shard (a row each)
        times their block scales (a row each), divided by ``count``."""
        return _scaled_signs(signs, scales, self.worker_blocks).sum(dim=0) / count

    def server_head(self, scale: torch.Tensor) -> torch.Tensor:
        """This rank's server block scales in its head's slots, zeros elsewhere."""
        return scale.new_zeros(self.head).index_copy_(0, self._head_slots, scale)

    def decoded(self, signs: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """The bucket's vector from every server's signs of its shard (a row each) times
        its block scales (its head, a row each)."""
        values = _scaled_signs(signs.reshape(1, -1), heads.reshape(1, -1), self.server_blocks)
        return values.reshape(-1).index_select(0, self._inverse)


def _int32(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` as int32 on ``device``: a bucket's elements number below 2^31, and an
    index per element is the size of the bucket's floats, not twice it."""
    return index.to(device=device, dtype=torch.int32)


def _scaled_signs(signs, scales, blocks):
    """Each row's signs (int8) times that row's scale of each element's block (``blocks``
    into the row; -1: 0); NaN for a non-finite scale, as ``rescale`` decodes it."""
    scales = torch.where(torch.isfinite(scales), scales, float("nan"))
    scales = torch.cat([scales, scales.new_zeros(scales.shape[0], 1)], dim=1)
    return signs.to(torch.float32) * scales[:, blocks]


def _residual_parts(bucket: GradientBucket, server_rank: int | None):
    """(member name, start, stop) of each member's residual within the bucket's, and the
    bucket's residual's length: the worker's (``server_rank`` None) and a replicated
    server's span the vector; a sharded server's, that rank's shard (``shard_pieces``)."""
    if server_rank is None or not bucket.shards:
        parts = [(m.plan.name, m.offset, m.stop) for m in bucket.members]
        return parts, bucket.numel
    pieces = bucket.shard_pieces(server_rank)
    parts = [(p.member.plan.name, p.column, p.column + p.valid) for p in pieces]
    return parts, sum(p.length for p in pieces)


def join_residuals(
    residuals: dict, bucket: GradientBucket, device: torch.device, server_rank=None
) -> None:
    """Moves the residuals of ``bucket``'s members, kept under their names (a restored
    state, or steps that sent them one by one), into one under the bucket's name: the
    worker's, or with ``server_rank`` that rank's server's (``_residual_parts``)."""
    parts, length = _residual_parts(bucket, server_rank)
    kept = {name: residuals.pop(name, None) for name, _, _ in parts}
    if not any(part is not None for part in kept.values()):
        return
    joined = torch.zeros(length, dtype=torch.float32, device=device)
    for name, start, stop in parts:
        if kept[name] is not None:
            joined[start:stop] = kept[name].reshape(-1)
    residuals[bucket.name] = joined


def split_residuals(
    residuals: dict, bucket: GradientBucket, server_rank=None, shaped=False
) -> dict:
    """``residuals`` with the bucket's one, if it has one, kept under its members' names
    instead, each a copy: flat, as the members' own residuals are, or ``shaped`` as their
    parameters, as momentum buffers are."""
    if bucket.name not in residuals:
        return residuals
    residuals = dict(residuals)
    joined = residuals.pop(bucket.name)
    shapes = {m.plan.name: m.plan.shape for m in bucket.members}
    for name, start, stop in _residual_parts(bucket, server_rank)[0]:
        part = joined[start:stop].clone()
        residuals[name] = part.view(shapes[name]) if shaped else part
    return residuals


class GradientBuckets:
    """A pipeline's gradient buckets, and those that carry this step's gradients.

    Args:
        codec: the pipeline's codec.
        bucket_bytes: the size at which a bucket closes (0: no buckets).
        plans: {parameter: its ``TensorPlan``}, whose exchanges the buckets follow.
        state: the pipeline's ``PipelineState``, whose worker and server residuals a
            bucket keeps under its own name while it carries its members.
        world_size, rank: the pipeline's world, which the buckets' layouts are for.
    """

    def __init__(self, codec, bucket_bytes: int, plans: dict, state, world_size: int, rank: int):
        self.codec, self.bucket_bytes, self.plans, self.state = codec, bucket_bytes, plans, state
        self.buckets = []
        self.make(world_size, rank)

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self):
        return len(self.buckets)

    def make(self, world_size: int, rank: int) -> None:
        """Lays the compressed tensors out in buckets for their exchanges among
        ``world_size`` ranks: at construction, and again when the world changed. The
        residuals of the old buckets go back under their members' names."""
        self.release()
        self.world_size, self.rank = world_size, rank
        self.buckets = gradient_buckets(
            list(self.plans.values()), self.codec, world_size, self.bucket_bytes
        )
        params = {plan.name: param for param, plan in self.plans.items()}
        # bucket name -> its members' parameters
        self.params = {b.name: [params[m.plan.name] for m in b.members] for b in self.buckets}
        self._layouts = {}  # bucket name -> its BucketLayout on the gradients' device
        self._carried = {}  # member name -> (layout, index) of this step's buckets
        self._arrived = {}  # bucket name -> {member index: its lr_ratio} of this step

    def release(self) -> None:
        """Keeps every bucket's residuals under its members' names: before the world they
        were laid out for changes."""
        for bucket in self.buckets:
            self._split(bucket)

    def release_momentum(self) -> None:
        """Keeps every bucket's momentum under its members' names (``WorkerMomentum.
        expose``); the next step joins it again."""
        for bucket in self.buckets:
            self._split_momentum(bucket)

    def _split(self, bucket: GradientBucket) -> None:
        """Keeps ``bucket``'s residuals and momentum under its members' names."""
        worker, server = self.state.worker, self.state.server
        if worker is not None:
            worker.residuals = split_residuals(worker.residuals, bucket)
        if server is not None:
            server.residuals = split_residuals(server.residuals, bucket, self.rank)
        self._split_momentum(bucket)

    def _split_momentum(self, bucket: GradientBucket) -> None:
        momentum = self.state.momentum
        if momentum is not None:
            momentum.momentum = split_residuals(momentum.momentum, bucket, shaped=True)

    def split_state(self, state: dict) -> dict:
        """``PipelineState.state_dict``'s ``state`` with every residual and momentum buffer
        under its tensor's name, whatever the buckets of this run."""
        for bucket in self.buckets:
            for role, rank in (("worker", None), ("server", self.rank)):
                if role in state:
                    state[role] = split_residuals(state[role], bucket, rank)
            if "momentum" in state:
                buffers = state["momentum"]["momentum"]
                state["momentum"]["momentum"] = split_residuals(buffers, bucket, shaped=True)
        return state

    def follow(self) -> None:
        """Takes the buckets that carry this step's gradients: those whose members all go
        by the bucket's exchange, are float32 and on one device, off the CPU kernels (on
        the eager ops, or Triton's kernels); asked at each step's first gradient, as
        placement is. Each bucket's residuals are kept under the name this step's
        exchanges use: the bucket's, or its members'."""
        self._carried = {}
        for bucket in self.buckets:
            params = self.params[bucket.name]
            device = params[0].device
            carried = all(
                m.plan.route == bucket.exchange
                and p.dtype == torch.float32
                and p.device == device
                and not fused.on_host(self.codec, p)
                for m, p in zip(bucket.members, params)
            )
            if not carried:
                self._split(bucket)
                continue
            layout = self._layouts.get(bucket.name)
            if layout is None or layout.device != device:
                layout = BucketLayout(bucket, self.codec, device, self.rank)
                self._layouts[bucket.name] = layout
            if self.state.worker is not None:
                join_residuals(self.state.worker.residuals, bucket, device)
            if self.state.server is not None:
                join_residuals(self.state.server.residuals, bucket, device, self.rank)
            if self.state.momentum is not None:
                join_residuals(self.state.momentum.momentum, bucket, device)
            for index, member in enumerate(bucket.members):
                self._carried[member.plan.name] = (layout, index)

    def units(self, plans: list) -> list[tuple[str, int]]:
        """(name, elements) of what travels for ``plans`` (in the parameters' order) this
        step: each plan's tensor, but for the members of a bucket that carries them, the
        bucket, at the place of the member whose gradient comes last (its first in the
        parameters' order)."""
        units = []
        for plan in plans:
            if plan.name not in self._carried:
                units.append((plan.name, plan.numel))
                continue
            bucket = self._carried[plan.name][0].bucket
            if bucket.members[-1].plan is plan:
                units.append((bucket.name, bucket.numel))
        return units

    def carries(self, name: str) -> bool:
        """Whether tensor ``name``'s gradient travels in a bucket this step."""
        return name in self._carried

    def put(self, name: str, grad: torch.Tensor, lr_ratio) -> BucketLayout | None:
        """Copies tensor ``name``'s gradient, whose residual ``lr_ratio`` is ``lr_ratio``, into
        its bucket; returns the bucket's layout once every member's is in, else None."""
        if grad.is_sparse:
            raise ValueError(
                f"bucket_bytes: {name}'s gradient is sparse, which a gradient bucket "
                f"cannot carry; pass sparse_as_dense=True to compress it, "
                f"uncompressed=[{name!r}] to send it by Horovod's sparse allreduce, or "
                f"bucket_bytes=0"
            )
        layout, index = self._carried[name]
        layout.put(index, grad)
        arrived = self._arrived.setdefault(layout.bucket.name, {})
        arrived[index] = lr_ratio
        return layout if len(arrived) == len(layout.bucket.members) else None

    def lr_ratio(self, layout: BucketLayout):
        """The learning-rate ratio of a full bucket's vector (``BucketLayout.lr_ratios``)."""
        arrived = self._arrived.pop(layout.bucket.name)
        return layout.lr_ratios([arrived[i] for i in range(len(arrived))])
