"""The codecs' per-element passes on CPU tensors, fused by ``hvd_compress.kernels``:
ef-sign's worker and server, and TernGrad's and the fixed-width QSGD family's scales,
encoding (with the draws of ``seeding.uniforms``, packing and residual) and decoding.

The codec, memory and exchange calls (``BlockSign``, ``TernGrad``, ``QSGD``, ...,
``ErrorFeedback``, ``ServerStep``, ``pt.exchange``) define the step and are what CUDA
tensors run; on CPU float32 tensors these calls do the same work in a few passes, with the
same results: codes, packed bytes, decoded values and residuals bit for bit, and scales
equal to the float64 reference's (the eager port's float64 sums are within float64
rounding of it, so its float32 scales very rarely differ in the last bit).

``HVD_COMPRESS_KERNELS=0`` in the environment keeps the eager calls everywhere, to compare
the two.
"""

import functools
import importlib.util
import os

import numpy as np
import torch

from hvd_compress.codes import IntCodes
from hvd_compress.seeding import key_words

from .blocksign import BlockSign

ENABLED = (
    importlib.util.find_spec("numba") is not None
    and os.environ.get("HVD_COMPRESS_KERNELS", "1") != "0"
)

# "No residual" for kernels that take an array.
_NONE = torch.empty(0).numpy()

# The codecs whose fixed-width codes the kernels quantize and decode.
_QUANTIZERS = ("terngrad", "qsgd", "qsgd-inf", "nuqsgd")


@functools.cache
def _kernels():
    """``hvd_compress.kernels``, imported when first needed: numba's import takes 0.25 s
    that a process without work for the kernels need not spend."""
    from hvd_compress import kernels

    return kernels


def applies(codec, tensor):
    """Whether ``codec``'s work on tensors like ``tensor`` goes through the kernels: CPU
    float32 tensors of ``BlockSign``, ``TernGrad`` and the QSGD family's fixed width (by
    name: the codec modules call this module)."""
    return (
        ENABLED
        and tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
        and (isinstance(codec, BlockSign) or codec.name in _QUANTIZERS and codec.wire == "fixed")
    )


def momentum(grad, buffer, mu, nesterov):
    """``WorkerMomentum``'s m = mu m + g and u = g + mu m (or m) in one pass over a
    contiguous ``grad``, which becomes u; returns the new m."""
    out = torch.empty_like(grad)
    _kernels().momentum(
        grad.view(-1).numpy(), buffer.reshape(-1).numpy(), mu, nesterov, out.view(-1).numpy()
    )
    return out


def compensated_scale(codec, vector, residual, ratio, momentum=None):
    """``ErrorFeedback.compensate`` and ``codec.local_scale``: (p, scale), p = u + residual
    * ratio. u is ``vector``, or with a ``momentum`` (``WorkerMomentum.Deferred``) the
    direction of ``WorkerMomentum.before_exchange``, whose new buffer is written in the
    same pass. Without either, p is ``vector`` itself. ``BlockSign``'s scales are summed
    in that pass; the quantizers' (a standard deviation, norms) take passes over p of
    their own (``local_scale``), and leave the pass's one sum unused."""
    numel = vector.numel()
    blocks = isinstance(codec, BlockSign)
    if not blocks and residual is None and momentum is None:
        return vector, local_scale(codec, vector)
    sums = torch.empty(codec.buckets(numel) if blocks else 1, dtype=torch.float64)
    p = vector if residual is None and momentum is None else torch.empty_like(vector)
    accelerate = (
        (_NONE, 0.0, False, _NONE)
        if momentum is None
        else (
            momentum.buffer.reshape(-1).numpy(),
            momentum.mu,
            momentum.nesterov,
            momentum.out.view(-1).numpy(),
        )
    )
    _kernels().compensated_block_l1(
        vector.detach().numpy(),
        *accelerate,
        _NONE if residual is None else residual.numpy(),
        ratio,
        codec.bucket_length(numel) if blocks else max(numel, 1),
        p.detach().numpy(),
        sums.numpy(),
    )
    return p, codec.scale_from_sums(sums, numel) if blocks else local_scale(codec, p)


def signs_with_feedback(codec, p, scale):
    """``BlockSign.encode``, packing, and the residual p - decode(codes) that
    ``ErrorFeedback.update`` keeps, in one pass: (packed signs, residual)."""
    packed = torch.empty(-(-p.numel() // 8), dtype=torch.uint8)
    residual = torch.empty_like(p)
    _kernels().signs_with_feedback(
        p.detach().numpy(),
        scale.numpy(),
        codec.bucket_length(p.numel()),
        packed.numpy(),
        residual.numpy(),
    )
    return packed, residual


def server_step(server, codec, bits, scales, count, numel):
    """``ServerStep`` of a server (of one shard, or replicated over a whole tensor) whose
    workers each sent their ``numel`` signs (rows of ``bits``) under one scale each
    (``scales``): the average, the server residual and the second compression. Returns
    (packed signs, scale) and proposes the new server residual."""
    p = torch.empty(numel, dtype=torch.float32)
    sums = torch.empty(codec.buckets(numel), dtype=torch.float64)
    previous = server.memory.residuals.get(server.key)
    _kernels().averaged_block_l1(
        bits.numpy(),
        scales.contiguous().numpy(),
        count,
        _NONE if previous is None else previous.numpy(),
        server.ratio,
        codec.bucket_length(numel),
        p.numpy(),
        sums.numpy(),
    )
    scale = codec.scale_from_sums(sums, numel)
    packed, residual = signs_with_feedback(codec, p, scale)
    server.memory.propose(server.key, residual)
    return packed, scale


def scaled_signs(bits, scales, numel):
    """``packing.unpack_scaled_signs``: the first ``numel`` signs of each row of ``bits``
    times that row's scale, as float32 rows."""
    out = torch.empty(bits.shape[0], numel, dtype=torch.float32)
    _kernels().scaled_signs(bits.numpy(), scales.reshape(-1).contiguous().numpy(), out.numpy())
    return out


def local_scale(codec, grad: torch.Tensor) -> torch.Tensor:
    """``TernGrad.local_scale`` (min(c sigma, max|g|), in two passes: the sum and max|g|,
    then the centered squares) or the QSGD family's (``_local_norms``: one pass); +inf
    everywhere for a non-finite gradient, as the eager ops."""
    g = grad.detach().reshape(-1).numpy()
    kernels = _kernels()
    if codec.name == "terngrad":
        if g.size == 0:
            return torch.zeros(1)
        total, top = kernels.sum_and_top(g, g.view(np.int32))
        scale = np.int32(top).view(np.float32)  # max|g|
        if not np.isfinite(total):
            scale = np.float32(np.inf)
        elif codec.clip != 0:
            variance = kernels.centered_squares(g, total / g.size) / g.size
            scale = min(np.float32(codec.clip) * np.float32(np.sqrt(variance)), scale)
        return torch.tensor([scale], dtype=torch.float32)
    d = codec.bucket_length(g.size)
    if getattr(codec, "norm", "l2") == "l2":
        sums = np.empty(codec.buckets(g.size), dtype=np.float64)
        kernels.bucket_squares(g, d, sums)
        scale = np.sqrt(sums).astype(np.float32)
    else:
        scale = np.empty(codec.buckets(g.size), dtype=np.int32)
        kernels.bucket_tops(g.view(np.int32), d, scale)
        scale = scale.view(np.float32)
    if not np.isfinite(scale).all():
        scale[:] = np.inf
    return torch.from_numpy(scale)


def _levels(codec):
    """(s, exponent) of the ``quantized`` kernel: s uniform levels, or 0 and NUQSGD's
    smallest level 2^-exponent."""
    return (0, codec.exponent) if codec.name == "nuqsgd" else (codec.levels, 0)


def _divisor(codec, count):
    """The divisor of ``codec.decode(total, scale, count)``."""
    levels, exponent = _levels(codec)
    return (levels or 2**exponent) * count


def encode(
    codec, exchange, p: torch.Tensor, scale: torch.Tensor, key: int, feedback: bool
) -> tuple:
    """``codec.encode`` of p under ``scale`` with the draws of stream ``key``
    (``seeding.uniforms``), written as ``exchange`` sends it (its ``payload``: packed
    codes, or values in the allreduce's carrier), and with ``feedback`` the residual
    p - decode(values(codes), scale, 1) of ``ErrorFeedback.update``, in one pass:
    (payload, residual or None). ef-sign's are ``signs_with_feedback``."""
    if isinstance(codec, BlockSign):
        return signs_with_feedback(codec, p, scale)
    payload = exchange.payload()
    residual = torch.empty_like(p) if feedback else None
    space = codec.code_space
    packed = payload.dtype == torch.uint8
    if packed:
        # Past the tensor's codes: the code 0 in every field (the sharded exchange's padding).
        payload[space.packed_nbytes(p.numel()) :] = sum(
            space.bound << (space.width * t) for t in range(space.codes_per_byte)
        )
    # numba has no float16: values for a float16 carrier are converted after the kernel.
    values = torch.empty(
        0 if packed else p.numel(),
        dtype=torch.int32 if payload.dtype == torch.float16 else payload.dtype,
    )
    levels, exponent = _levels(codec)
    _kernels().quantized(
        p.detach().numpy(),
        scale.reshape(-1).contiguous().numpy(),
        codec.bucket_length(p.numel()),
        levels,
        exponent,
        *(np.uint32(word) for word in key_words(key)),
        space.bound,
        space.width,
        values.numpy(),
        payload.numpy() if packed else _NONE.view(np.uint8),
        _NONE if residual is None else residual.numpy(),
    )
    if not packed:
        payload = values if values.dtype == payload.dtype else values.to(payload.dtype)
    return payload, residual


@functools.cache
def _table(codec, space):
    """Row ``byte``: the values of the fields of ``byte`` in ``space`` (of at most 8 bits):
    ``codec.values`` of codes, or with no codec the fields less the bound (sums)."""
    fields = np.arange(2**space.width) - space.bound
    if codec is not None:
        fields = codec.values(
            torch.from_numpy(fields.clip(-space.bound, space.bound)).to(torch.int32)
        ).numpy()
    per = space.codes_per_byte
    shifts = space.width * np.arange(per)
    return fields[(np.arange(256)[:, None] >> shifts) & (2**space.width - 1)].astype(np.int32)


def _rows(codec, space, rows):
    """The kernels' arguments for packed ``rows`` in ``space``: rows, table, width, bound."""
    table = _table(codec, space) if space.width <= 8 else np.zeros((0, 1), np.int32)
    return rows.numpy(), table, space.width, space.bound


def decoded_totals(codec, total: torch.Tensor, scale: torch.Tensor, count: int) -> torch.Tensor:
    """``codec.decode`` of the allreduce's summed values ``total``."""
    out = torch.empty(total.shape, dtype=torch.float32)
    if total.dtype == torch.float16:  # exact integers: numba has no float16
        total = total.to(torch.float32)
    _kernels().decoded_totals(
        total.numpy(),
        scale.reshape(-1).contiguous().numpy(),
        codec.bucket_length(total.numel()),
        _divisor(codec, count),
        out.numpy(),
    )
    return out


def summed_codes(codec, rows: torch.Tensor, length: int, total_space: IntCodes) -> torch.Tensor:
    """The sharded exchange's partial sum: the values of the first ``length`` codes of
    every row, summed over the rows and packed in ``total_space``."""
    out = torch.empty(total_space.packed_nbytes(length), dtype=torch.uint8)
    _kernels().summed_codes(
        *_rows(codec, codec.code_space, rows),
        length,
        total_space.bound,
        total_space.width,
        out.numpy(),
    )
    return out


def decoded_sums(
    codec, rows: torch.Tensor, scale: torch.Tensor, count: int, numel: int
) -> torch.Tensor:
    """The allgather's ``codec.decode`` of the sum over the rows' values, shared scale."""
    out = torch.empty(numel, dtype=torch.float32)
    _kernels().decoded_sums(
        *_rows(codec, codec.code_space, rows),
        scale.reshape(-1).contiguous().numpy(),
        codec.bucket_length(numel),
        _divisor(codec, count),
        out.numpy(),
    )
    return out


def decoded_own_scales(
    codec, rows: torch.Tensor, scales: torch.Tensor, count: int, numel: int
) -> torch.Tensor:
    """The allgather's sum over the rows of ``codec.decode`` of their values, each row
    under its own scales (row of ``scales``)."""
    out = torch.empty(numel, dtype=torch.float32)
    _kernels().decoded_own_scales(
        *_rows(codec, codec.code_space, rows),
        scales.contiguous().numpy(),
        codec.bucket_length(numel),
        _divisor(codec, count),
        out.numpy(),
    )
    return out


def decoded_segments(
    codec,
    rows: torch.Tensor,
    total_space: IntCodes,
    length: int,
    scale: torch.Tensor,
    count: int,
    numel: int,
) -> torch.Tensor:
    """The sharded exchange's ``codec.decode`` of the gathered partial sums: row r is
    elements r length .. (r + 1) length - 1, packed in ``total_space``."""
    out = torch.empty(numel, dtype=torch.float32)
    _kernels().decoded_segments(
        *_rows(None, total_space, rows),
        length,
        scale.reshape(-1).contiguous().numpy(),
        codec.bucket_length(numel),
        _divisor(codec, count),
        out.numpy(),
    )
    return out
