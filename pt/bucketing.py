"""A gradient bucket (``hvd_compress.bucketing``) on a device: the vector its members'
gradients are copied into, the segments its codec reduces over, its members' draws, and
the moves of their residuals between their own names and the bucket's."""

from __future__ import annotations

import copy

import torch

from hvd_compress.bucketing import GradientBucket
from hvd_compress.seeding import key_words

from .buckets import Segments
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
        starts = _indices([start for start, _ in spans], device)
        numel = bucket.numel
        # Each element's counter in its member's stream: its index within the member.
        self._counters = torch.arange(numel, device=device) - torch.repeat_interleave(
            starts, self._spans, output_size=numel
        )
        self.vector = torch.zeros(numel, dtype=torch.float32, device=device)
        self._views = self._shaped(self.vector)
        self._decoded = self._shaped(self.segments.decoded)

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
        lo, multiplier = (
            torch.repeat_interleave(w, self._spans, output_size=self.bucket.numel)
            for w in words.unbind(1)
        )
        return stream_uniforms(self._counters, lo, multiplier)

    def members(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Each member's part of a bucket-long ``vector``: in its shape where ``vector`` is
        where the kernels decode (views made once), else flat."""
        if vector is self.segments.decoded:
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
