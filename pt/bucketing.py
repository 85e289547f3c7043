"""Gradient buckets (``hvd_compress.bucketing``) in a PyTorch pipeline: which buckets carry a
step's gradients (``GradientBuckets``), each laid out on its device (``BucketLayout``: the
vector its members' gradients are copied into, the segments its codec reduces over, its
members' draws), and the moves of their residuals between their own names and the
bucket's."""

from __future__ import annotations

import copy

import torch

from hvd_compress.bucketing import GradientBucket, gradient_buckets
from hvd_compress.seeding import key_words

from . import fused
from .buckets import Segments
from .memory import ErrorFeedback
from .seeding import stream_uniforms


def _indices(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


class BucketLayout:
    """``bucket`` laid out on ``device`` for ``codec``.

    Attributes:
        vector: the bucket's float32 gradients, each member's copied in as it arrives
            (``put``); the padding stays zero.
        codec: a copy of ``codec`` whose blocks are the bucket's ``segments``: the
            pipeline codes the vector with it as it would one tensor.
    """

    def __init__(self, bucket: GradientBucket, codec, device: torch.device):
        self.bucket = bucket
        self.device = device
        lengths, blocks = bucket.block_lengths(codec)
        spans = bucket.spans()
        groups, members, first_block = [], [], 0
        for member, (offset, length) in zip(bucket.members, spans):
            numel = member.plan.numel
            groups.append(codec.buckets(numel))
            members.append((offset, numel, length, first_block, codec.bucket_length(numel)))
            first_block += groups[-1]
        self.segments = Segments(lengths, blocks, groups, members, device)
        self.codec = copy.copy(codec)
        self.codec.bucket_length = lambda numel: self.segments
        self.codec.buckets = lambda numel: self.segments.count
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

    def ratios(self, ratios: list):
        """One learning-rate ratio for the vector from its members' (``launch``): theirs if
        they are all one value, else each member's over its elements."""
        first = ratios[0]
        if all(r is first or (not isinstance(r, torch.Tensor) and r == first) for r in ratios):
            return first
        per_member = torch.stack(
            [torch.as_tensor(r, dtype=torch.float32, device=self.device) for r in ratios]
        )
        return torch.repeat_interleave(per_member, self._spans, output_size=self.bucket.numel)


def join_residuals(residuals: dict, bucket: GradientBucket, device: torch.device) -> None:
    """Moves the residuals of ``bucket``'s members, kept under their names (a restored
    state, or steps that sent them one by one), into one under the bucket's name."""
    parts = {m.plan.name: residuals.pop(m.plan.name, None) for m in bucket.members}
    if not any(part is not None for part in parts.values()):
        return
    joined = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
    for member in bucket.members:
        part = parts[member.plan.name]
        if part is not None:
            joined[member.offset : member.stop] = part.reshape(-1)
    residuals[bucket.name] = joined


def split_residuals(residuals: dict, bucket: GradientBucket) -> dict:
    """``residuals`` with the bucket's one, if it has one, kept under its members' names
    instead, each a copy (flat, as the members' own residuals are)."""
    if bucket.name not in residuals:
        return residuals
    residuals = dict(residuals)
    joined = residuals.pop(bucket.name)
    for member in bucket.members:
        residuals[member.plan.name] = joined[member.offset : member.stop].clone()
    return residuals


class GradientBuckets:
    """A pipeline's gradient buckets, and those that carry this step's gradients.

    Args:
        codec: the pipeline's codec.
        bucket_bytes: the size at which a bucket closes (0: no buckets).
        plans: {parameter: its ``TensorPlan``}, whose exchanges the buckets follow.
        worker: the pipeline's worker residuals, or None.
    """

    def __init__(self, codec, bucket_bytes: int, plans: dict, worker: ErrorFeedback | None):
        self.codec, self.bucket_bytes, self.plans = codec, bucket_bytes, plans
        self.buckets = []
        self.make(worker)

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self):
        return len(self.buckets)

    def make(self, worker: ErrorFeedback | None) -> None:
        """Lays the compressed tensors out in buckets for their exchanges: at construction,
        and again when ``exchange="auto"`` chose them anew. The residuals of the old
        buckets go back under their members' names."""
        if worker is not None:
            for bucket in self.buckets:
                worker.residuals = split_residuals(worker.residuals, bucket)
        self.buckets = gradient_buckets(list(self.plans.values()), self.codec, self.bucket_bytes)
        params = {plan.name: param for param, plan in self.plans.items()}
        # bucket name -> its members' parameters
        self.params = {b.name: [params[m.plan.name] for m in b.members] for b in self.buckets}
        self._layouts = {}  # bucket name -> its BucketLayout on the gradients' device
        self._carried = {}  # member name -> (layout, index) of this step's buckets
        self._arrived = {}  # bucket name -> {member index: its ratio} of this step

    def follow(self, worker: ErrorFeedback | None) -> None:
        """Takes the buckets that carry this step's gradients: those whose members all go
        by the bucket's exchange, are float32 and on one device, off the CPU kernels (on
        the eager ops, or Triton's kernels); asked at each step's first gradient, as
        placement is. Each bucket's residual is kept under the name this step's exchanges
        use: the bucket's, or its members'."""
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
                if worker is not None:
                    worker.residuals = split_residuals(worker.residuals, bucket)
                continue
            layout = self._layouts.get(bucket.name)
            if layout is None or layout.device != device:
                layout = self._layouts[bucket.name] = BucketLayout(bucket, self.codec, device)
            if worker is not None:
                join_residuals(worker.residuals, bucket, device)
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

    def put(self, name: str, grad: torch.Tensor, ratio) -> BucketLayout | None:
        """Copies tensor ``name``'s gradient, whose residual ``ratio`` is ``ratio``, into
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
        arrived[index] = ratio
        return layout if len(arrived) == len(layout.bucket.members) else None

    def ratio(self, layout: BucketLayout):
        """The residual ratio of a full bucket's vector (``BucketLayout.ratios``)."""
        arrived = self._arrived.pop(layout.bucket.name)
        return layout.ratios([arrived[i] for i in range(len(arrived))])
