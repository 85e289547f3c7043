"""A gradient's exchange while a step has it in flight: what ``CompressionPipeline`` knows
of each tensor, or gradient bucket, between the hook that launched it and ``synchronize``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from hvd_compress.plan import TensorPlan

from .bucketing import BucketLayout


@dataclasses.dataclass
class Flight:
    plan: TensorPlan
    param: torch.Tensor | None  # None for a gradient bucket
    # "shard" (a two-level exchange's node reduce-scatter), "scale", "codes", "gather"
    # (its node allgather) or "plain" (an allreduce, fp32 or fp16)
    stage: str
    # The Horovod collective the flight waits for before its next stage: a two-level
    # shard's node average ("shard") or a shared scale's Max-allreduce ("scale").
    handle: int | None = None
    # "codes": the exchange's message in transit, what its ``advance`` and ``finish`` take.
    message: object = None
    # "plain" and "gather": waits for the collective and returns its output.
    result: Callable[[], torch.Tensor] | None = None
    vector: torch.Tensor | None = None  # the flattened gradient, plus the worker residual
    scale: torch.Tensor | None = None
    exchange: object = None
    fused: bool = False  # worker error feedback by ``fused``'s kernels
    scale_in_encode: bool = False  # the scale taken in the encoding's pass
    compensated: bool = False  # ``vector`` a buffer of the compensation's, free to overwrite
    lr_ratio: float = 1.0  # eta_{t-1} / eta_t of the step, for residuals compensated later
    layout: BucketLayout | None = None  # a gradient bucket's flight: the bucket, else None
    decoded: torch.Tensor | None = None  # a bucket's decoded vector, once it has arrived
