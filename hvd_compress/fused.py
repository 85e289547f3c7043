"""The fused CPU kernels' calls (``hvd_compress.kernels``) on numpy arrays, shared by the
ports: ``hvd_compress.pt.fused`` passes the arrays behind CPU tensors, and
``hvd_compress.tf.fused`` the arrays a ``tf.numpy_function`` receives. ef-sign's worker
(momentum, compensation, block scales, signs, residual) and server; TernGrad's and the
fixed-width QSGD family's scales, encoding (draws, rounding, packing, residual) and decoding
on each exchange's receiving side.

Each call gives what the codec's eager ops give, bit for bit: the codes, packed bytes,
decoded values and residuals; the scales are the float64 reference's (the ports' float64
sums are within float64 rounding of it, so their float32 scales very rarely differ in the
last bit).
"""

import functools
import importlib.util
import math
import os

import numpy as np

from hvd_compress.blocksign import BlockSign
from hvd_compress.codes import IntCodes
from hvd_compress.seeding import key_words
from hvd_compress.terngrad import shifted_variance

# Numba installed, and not turned off by ``HVD_COMPRESS_KERNELS=0`` (which keeps the eager
# ops everywhere, to compare the two).
AVAILABLE = (
    importlib.util.find_spec("numba") is not None
    and os.environ.get("HVD_COMPRESS_KERNELS", "1") != "0"
)

# The codecs whose fixed-width codes the kernels quantize and decode.
QUANTIZERS = ("terngrad", "qsgd", "qsgd-inf", "nuqsgd")

# "No array" for kernels that take one.
NONE = np.empty(0, dtype=np.float32)

# TensorFlow adopts an array a ``tf.numpy_function`` returns without a copy only if its data
# start on a multiple of this many bytes; numpy's own allocations start 16 bytes past one.
ALIGNMENT = 64


def empty(shape, dtype=np.float32) -> np.ndarray:
    """``np.empty``, its data aligned to ``ALIGNMENT`` bytes."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    # math.prod: numpy's reduction costs microseconds, and every kernel call allocates.
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    # One constructor over the buffer, where a slice, a view and a reshape are three calls.
    return np.ndarray(shape, dtype, buffer, -buffer.ctypes.data % ALIGNMENT)


@functools.cache
def kernels():
    """``hvd_compress.kernels``, imported when first needed: numba's import takes 0.25 s
    that a process without work for the kernels need not spend."""
    from hvd_compress import kernels

    return kernels


def covers(codec) -> bool:
    """Whether the kernels do ``codec``'s per-element work: ``BlockSign``, or a
    ``quantizes`` codec."""
    return isinstance(codec, BlockSign) or quantizes(codec)


def quantizes(codec) -> bool:
    """Whether the kernels encode and decode ``codec``'s codes: TernGrad and the QSGD
    family with fixed-width codes."""
    return codec.name in QUANTIZERS and codec.wire == "fixed"


def momentum_factor(mu: float, rounded_per_op: bool) -> np.floating:
    """The momentum mu as the kernels take it, which sets how they round m = mu m + g and
    u = g + mu m: once from float64, as PyTorch's ``add(alpha=mu)`` (a float64 of the
    float32 mu), or after the product and after the sum, as TensorFlow's multiply and add
    ops (``rounded_per_op``: a float32)."""
    return np.float32(mu) if rounded_per_op else np.float64(np.float32(mu))


def momentum(grad: np.ndarray, buffer: np.ndarray, mu: np.floating, nesterov: bool) -> np.ndarray:
    """``WorkerMomentum``'s m = mu m + g and u = g + mu m (or m) in one pass over ``grad``,
    which becomes u, with ``mu`` from ``momentum_factor``; returns the new m."""
    out = empty(grad.shape)
    kernels().momentum(grad, buffer, mu, nesterov, out)
    return out


def compensated_scale(
    codec,
    vector: np.ndarray,
    residual: np.ndarray | None,
    lr_ratio: float,
    momentum: tuple | None = None,
) -> tuple:
    """``ErrorFeedback.compensate`` and ``codec.local_scale``: (p, scale), p = u + residual
    * lr_ratio. u is ``vector``, or with a ``momentum`` (buffer, mu from ``momentum_factor``,
    nesterov, new buffer: ``WorkerMomentum.Deferred``'s) the direction of
    ``WorkerMomentum.before_exchange``, whose new buffer is written in the same pass.
    Without either, p is ``vector`` itself. ``BlockSign``'s scales are summed in that
    pass; the quantizers' (a standard deviation, norms) take passes over p of their own
    (``local_scale``), and leave the pass's one sum unused."""
    p, sums = compensated(codec, vector, residual, lr_ratio, momentum)
    if isinstance(codec, BlockSign):
        return p, BlockSign.scale_from_sums(codec, sums, vector.size)
    return p, local_scale(codec, p)


def compensated(codec, vector: np.ndarray, residual, lr_ratio: float, momentum=None) -> tuple:
    """p of ``compensated_scale``, and ``BlockSign``'s float64 sums of |p| over its blocks
    (for another codec one sum, unused, or None where p is ``vector`` itself)."""
    blocks = isinstance(codec, BlockSign)
    if not blocks and residual is None and momentum is None:
        return vector, None
    sums = np.empty(codec.buckets(vector.size) if blocks else 1, dtype=np.float64)
    p = vector if residual is None and momentum is None else empty(vector.shape)
    kernels().compensated_block_l1(
        vector,
        *((NONE, 0.0, False, NONE) if momentum is None else momentum),
        NONE if residual is None else residual,
        lr_ratio,
        codec.bucket_length(vector.size) if blocks else max(vector.size, 1),
        p,
        sums,
    )
    return p, sums


def compensated_encode(
    codec,
    vector: np.ndarray,
    residual: np.ndarray | None,
    lr_ratio: float,
    momentum: tuple | None,
    key: int,
    payload: np.ndarray,
    feedback: bool,
) -> tuple:
    """``compensated_scale`` then ``encode`` (``BlockSign``: ``signs_with_feedback``), for
    a scale that no collective shares between them: (payload, scale, residual, None without
    ``feedback``). ``payload`` is an empty array in the exchange's format."""
    kept = empty(vector.shape) if feedback and not isinstance(codec, BlockSign) else None
    if scales_in_encode(codec, vector.size):
        p = compensated(codec, vector, residual, lr_ratio, momentum)[0]
        return (*scaled_encode(codec, p, key, payload, kept), kept)
    p, scale = compensated_scale(codec, vector, residual, lr_ratio, momentum)
    if isinstance(codec, BlockSign):
        packed, kept = signs_with_feedback(codec, p, scale, in_place=p is not vector)
        return packed, scale, kept if feedback else None
    return encode(codec, p, scale, key, payload, kept), scale, kept


def signs_with_feedback(codec, p: np.ndarray, scale: np.ndarray, in_place=False) -> tuple:
    """``BlockSign.encode``, packing, and the residual p - decode(codes) that
    ``ErrorFeedback.update`` keeps, in one pass: (packed signs, residual). ``in_place``:
    the residual is written over p, a temporary of the caller's: one gradient-sized
    buffer less, and writes to lines the pass has just read."""
    packed = empty(-(-p.size // 8), np.uint8)
    residual = p if in_place else empty(p.shape)
    kernels().signs_with_feedback(
        p, scale, codec.bucket_length(p.size), packed, NONE if in_place else residual
    )
    return packed, residual


def server_step(
    codec,
    messages: np.ndarray,
    head: int,
    block: int,
    count: int,
    previous: np.ndarray | None,
    lr_ratio: float,
    numel: int,
) -> tuple:
    """``ServerStep`` of a server (of one shard, or replicated over a whole tensor) whose
    workers each sent a message (row of ``messages``: ``head`` bytes of float32 block
    scales, then the server's ``numel`` packed signs, all in scale block ``block``), with
    its ``previous`` residual: the average, the compensation and the second compression.
    Returns (packed signs, scale, new residual)."""
    scales, bits = split_messages(messages, head)
    p = empty(numel)
    sums = np.empty(codec.buckets(numel), dtype=np.float64)
    kernels().averaged_block_l1(
        bits,
        np.ascontiguousarray(scales[:, block]),
        count,
        NONE if previous is None else previous,
        lr_ratio,
        codec.bucket_length(numel),
        p,
        sums,
    )
    scale = BlockSign.scale_from_sums(codec, sums, numel)
    packed, residual = signs_with_feedback(codec, p, scale, in_place=True)
    return packed, scale, residual


def _scale_bytes(scale: np.ndarray) -> np.ndarray:
    """The bytes of ``scale`` as float32, the head of a message that carries it."""
    return scale.astype(np.float32, copy=False).reshape(-1).view(np.uint8)


def headed(scale: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """One worker's message of an exchange that sends its own scales: the bytes of its
    float32 ``scale``, then its ``packed`` codes."""
    head = _scale_bytes(scale)
    message = np.empty(head.size + packed.size, np.uint8)
    message[: head.size] = head
    message[head.size :] = packed
    return message


def sharded_messages(
    scale: np.ndarray, packed: np.ndarray, count: int, shard_bytes: int
) -> np.ndarray:
    """A worker's rows of a sharded exchange that sends its own scales: row k is the bytes
    of its float32 ``scale``, then shard k of its ``packed`` codes, ``shard_bytes`` bytes
    of them, zero bytes past the codes (+1 codes, which every receiver cuts off)."""
    head = _scale_bytes(scale)
    rows = empty((count, head.size + shard_bytes), np.uint8)
    rows[:, : head.size] = head
    whole = count * shard_bytes
    if packed.size < whole:  # most layers' codes fill their shards exactly
        padded = np.zeros(whole, np.uint8)
        padded[: packed.size] = packed
        packed = padded
    rows[:, head.size :] = packed[:whole].reshape(count, shard_bytes)
    return rows


def server_message(
    scale: np.ndarray, scale_bytes: int, packed: np.ndarray, shard_bytes: int
) -> np.ndarray:
    """A sharded server's row: the bytes of its float32 block ``scale`` and zeros to
    ``scale_bytes``, then its ``packed`` signs and zeros to ``shard_bytes`` (all servers'
    rows are as long as the first shard's)."""
    row = np.zeros((1, scale_bytes + shard_bytes), np.uint8)
    head = _scale_bytes(scale)
    row[0, : head.size] = head
    row[0, scale_bytes : scale_bytes + packed.size] = packed
    return row


def servers_signs(rows: np.ndarray, length: int, numel: int) -> tuple:
    """The sharded servers' result from their gathered rows (``server_message`` with one
    float32 scale each, ``length`` signs): the first ``numel`` of their signs, in order,
    each times its server's scale (NaN for a non-finite one); and whether every scale is
    finite."""
    scales, bits = split_messages(rows, 4)
    out = scaled_signs(bits, scales, length)
    return out.reshape(-1)[:numel], bool(np.isfinite(scales).all())


def split_messages(messages: np.ndarray, head: int) -> tuple:
    """Gathered messages (rows) of ``head`` bytes of float32 scales, then packed codes:
    (the scales, a row per message; the codes, a view of the rows)."""
    return np.ascontiguousarray(messages[:, :head]).view(np.float32), messages[:, head:]


def scaled_signs(bits: np.ndarray, scales: np.ndarray, numel: int) -> np.ndarray:
    """``packing.unpack_scaled_signs``: the first ``numel`` signs of each row of ``bits``
    times that row's scale, as float32 rows."""
    out = empty((bits.shape[0], numel))
    kernels().scaled_signs(bits, scales.reshape(-1), out)
    return out


def local_scale(codec, g: np.ndarray) -> np.ndarray:
    """``TernGrad.local_scale`` (min(c sigma, max|g|)) or the QSGD family's
    (``_local_norms``), each in one pass over the flat float32 ``g``; +inf everywhere for a
    non-finite gradient, as the eager ops."""
    if codec.name == "terngrad":
        if g.size == 0:
            return np.zeros(1, dtype=np.float32)
        total, squares, top = kernels().shifted_moments_and_top(g, g.view(np.int32))
        scale = np.int32(top).view(np.float32)  # max|g|
        if not np.isfinite(total):  # d = g - g[0] is not finite where g is not
            scale = np.float32(np.inf)
        elif codec.clip != 0:
            sigma = np.sqrt(shifted_variance(total, squares, g.size))
            scale = min(np.float32(codec.clip) * np.float32(sigma), scale)
        return np.array([scale], dtype=np.float32)
    d = codec.bucket_length(g.size)
    if _norm(codec) == kernels().L2_NORMS:
        sums = np.empty(codec.buckets(g.size), dtype=np.float64)
        kernels().bucket_squares(g, d, sums)
        scale = np.sqrt(sums).astype(np.float32)
    else:
        scale = np.empty(codec.buckets(g.size), dtype=np.int32)
        kernels().bucket_tops(g.view(np.int32), d, scale)
        scale = scale.view(np.float32)
    if not np.isfinite(scale).all():
        scale[:] = np.inf
    return scale


def _nonuniform(codec) -> bool:
    """Whether ``codec``'s codes stand for NUQSGD's levels (their values sign(c) 2^(|c| - 1)),
    not for multiples of the scale's 1/s."""
    return codec.name == "nuqsgd"


def _levels(codec):
    """(s, exponent) of the ``quantized`` kernel: s uniform levels, or 0 and NUQSGD's
    smallest level 2^-exponent."""
    return (0, codec.exponent) if _nonuniform(codec) else (codec.levels, 0)


def divisor(codec, count: int) -> int:
    """The divisor of ``codec.decode(total, scale, count)``."""
    levels, exponent = _levels(codec)
    return (levels or 2**exponent) * count


@functools.cache
def _padding_byte(space: IntCodes) -> int:
    """A byte of ``space``'s code 0 in every field: what a packed row holds past its last
    code. Cached: every encoding asks."""
    return sum(space.bound << (space.width * t) for t in range(space.codes_per_byte))


def encode(
    codec,
    p: np.ndarray,
    scale: np.ndarray,
    key: int,
    payload: np.ndarray,
    residual: np.ndarray | None,
) -> np.ndarray:
    """``codec.encode`` of p under ``scale`` with the draws of stream ``key``
    (``seeding.uniforms``), written as the exchange sends it: into ``payload`` if it is
    uint8 (packed codes, the code 0 in every field past p's: the sharded exchange's
    padding), else as the codes' values in the allreduce's carrier (``payload``'s dtype).
    With a ``residual`` array, p - decode(values(codes), scale, 1) goes there, in the same
    pass. Returns the payload."""
    return _quantized(codec, p, kernels().GIVEN_SCALES, scale, key, payload, residual)[0]


def scaled_encode(
    codec, p: np.ndarray, key: int, payload: np.ndarray, residual: np.ndarray | None
) -> tuple:
    """``local_scale`` and ``encode`` of a QSGD-family codec (``scales_in_encode``) in one
    pass over p, each bucket's norm taken while its elements are in the cache: (payload,
    scale)."""
    scale = np.empty(codec.buckets(p.size), dtype=np.float32)
    payload, finite = _quantized(codec, p, _norm(codec), scale, key, payload, residual)
    if not finite:  # rare: encoded again under the scales of a non-finite gradient
        scale[:] = np.inf
        payload = encode(codec, p, scale, key, payload, residual)
    return payload, scale


def scales_in_encode(codec, numel: int) -> bool:
    """Whether ``scaled_encode`` can take ``codec``'s scales of a tensor of ``numel``
    elements: the QSGD family's bucket norms, for a tensor that has elements."""
    return _norm(codec) is not None and numel > 0


def _norm(codec) -> int | None:
    """The kernels' name (``kernels.L2_NORMS``, ``MAX_NORMS``) of the QSGD family's norm
    of a bucket, None for another codec."""
    if codec.name == "terngrad" or codec.name not in QUANTIZERS:
        return None
    return kernels().L2_NORMS if getattr(codec, "norm", "l2") == "l2" else kernels().MAX_NORMS


def _quantized(codec, p, norm, scale, key, payload, residual) -> tuple:
    """``kernels.quantized``: (payload, whether every scale it took is finite)."""
    space = codec.code_space
    packed = payload.dtype == np.uint8
    if packed:
        payload[space.packed_nbytes(p.size) :] = _padding_byte(space)
    # numba has no float16: values for a float16 carrier are converted after the kernel.
    values = empty(
        0 if packed else p.size, np.int32 if payload.dtype == np.float16 else payload.dtype
    )
    levels, exponent = _levels(codec)
    finite = kernels().quantized(
        p,
        p.view(np.int32),
        norm,
        scale.reshape(-1),
        codec.bucket_length(p.size),
        levels,
        exponent,
        tuple(np.uint32(word) for word in key_words(key)),
        space.bound,
        space.width,
        values,
        payload if packed else NONE.view(np.uint8),
        NONE if residual is None else residual,
    )
    if not packed:
        payload = values if values.dtype == payload.dtype else values.astype(payload.dtype)
    return payload, finite


def decoded_totals(codec, total: np.ndarray, scale: np.ndarray, count: int) -> np.ndarray:
    """``codec.decode`` of the allreduce's summed values ``total``."""
    out = empty(total.shape)
    if total.dtype == np.float16:  # exact integers: numba has no float16
        total = total.astype(np.float32)
    kernels().decoded_totals(
        total, scale.reshape(-1), codec.bucket_length(total.size), divisor(codec, count), out
    )
    return out


def summed_codes(codec, rows: np.ndarray, length: int, total_space: IntCodes) -> np.ndarray:
    """The sharded exchange's partial sum: the values of the first ``length`` codes of
    every (packed) row, summed over the rows and packed in ``total_space``."""
    space = codec.code_space
    out = empty(total_space.packed_nbytes(length), np.uint8)
    kernels().summed_codes(
        rows,
        space.width,
        space.bound,
        _nonuniform(codec),
        length,
        total_space.bound,
        total_space.width,
        out,
    )
    return out


def decoded_sums(codec, rows: np.ndarray, scale: np.ndarray, count: int, numel: int) -> np.ndarray:
    """The allgather's ``codec.decode`` of the sum over the rows' values, under the shared
    scale."""
    space = codec.code_space
    out = empty(numel)
    kernels().decoded_sums(
        rows,
        space.width,
        space.bound,
        _nonuniform(codec),
        scale.reshape(-1),
        codec.bucket_length(numel),
        divisor(codec, count),
        out,
    )
    return out


def decoded_own_scales(
    codec, messages: np.ndarray, head: int, count: int, numel: int
) -> np.ndarray:
    """The allgather's sum over the workers' ``messages`` (rows: ``head`` bytes of float32
    scales, then the codes) of ``codec.decode`` of their values, each under its own
    scales."""
    scales, rows = split_messages(messages, head)
    space = codec.code_space
    out = empty(numel)
    kernels().decoded_own_scales(
        rows,
        space.width,
        space.bound,
        _nonuniform(codec),
        scales,
        codec.bucket_length(numel),
        divisor(codec, count),
        out,
    )
    return out


def decoded_segments(
    codec,
    rows: np.ndarray,
    total_space: IntCodes,
    length: int,
    scale: np.ndarray,
    count: int,
    numel: int,
) -> np.ndarray:
    """The sharded exchange's ``codec.decode`` of the gathered partial sums: row r is
    elements r length .. (r + 1) length - 1, packed in ``total_space``."""
    out = empty(numel)
    kernels().decoded_segments(
        rows,
        total_space.width,
        total_space.bound,
        length,
        scale.reshape(-1),
        codec.bucket_length(numel),
        divisor(codec, count),
        out,
    )
    return out
