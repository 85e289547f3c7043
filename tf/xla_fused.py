"""The codecs' per-element passes on device tensors, compiled by XLA: each call of
``fused``'s for TernGrad, the fixed-width QSGD family and ef-sign (scales, compensation,
encoding with the draws of ``seeding.uniforms``, packing and residual; each exchange's
receiving side; ef-sign's server) is the TensorFlow ops that define it, run as one
``tf.function(jit_compile=True)`` between Horovod's collectives, which XLA cannot compile.
XLA fuses the ops into a few loops on the tensor's device, the int32 arithmetic of
packing and decoding included, which TensorFlow's graph executor would keep on the host
beside a GPU. Mirrors ``hvd_compress.pt.triton_fused``, the PyTorch port's device path.

The calls give the ops' results bit for bit (``tests/test_tf_kernels.py`` checks every call
and a tape loop on CPU): XLA rewrites a division by a constant into a multiplication by its
rounded reciprocal, so every divisor (the workers averaged over, the levels) reaches a
compiled function as a tensor argument; and it contracts a product feeding a sum into one
fused multiply-add, rounded once, which ``_compensate`` and ``UniformQuantizer.rounding``
prevent.

``HVD_COMPRESS_KERNELS=xla`` in the environment sends CPU tensors here instead of to the
numba kernels: XLA compiles for the CPU too, to test and count the device path on a machine
without a GPU. ``HVD_COMPRESS_KERNELS=0`` keeps the ops uncompiled everywhere.
"""

import os
import threading

import tensorflow as tf

from hvd_compress import fused as core
from hvd_compress.blocksign import BlockSign
from hvd_compress.codes import SignCodes

from . import decoding, seeding
from .codec import divide
from .packing import float_rows, pack, unpack

# Whether the compiled calls run at all (``HVD_COMPRESS_KERNELS=0`` keeps the ops).
ENABLED = os.environ.get("HVD_COMPRESS_KERNELS", "1") != "0"
# Whether CPU tensors take the compiled calls instead of the numba kernels.
ON_CPU = os.environ.get("HVD_COMPRESS_KERNELS") == "xla"

# Calls of compiled functions made so far (traced calls count once per trace), for tests.
calls = 0

# Whether this thread is tracing a compiled function, inside which the codecs' own calls
# (``TernGrad.local_scale``, the exchanges' decoding) must run their ops, not call back here.
_tracing = threading.local()


def applies(codec, on_cpu: bool) -> bool:
    """Whether the compiled calls take ``codec``'s work on float32 tensors on the CPU
    (``on_cpu``) or a GPU: ``BlockSign``, TernGrad and the QSGD family's fixed width."""
    tracing = getattr(_tracing, "active", False)
    return ENABLED and not tracing and (ON_CPU or not on_cpu) and core.covers(codec)


def _compiled(function):
    """``function`` XLA-compiled: its tensor arguments are the compiled function's, its other
    arguments (codecs, exchanges, lengths) choose the trace. The codecs' calls inside run
    their ops."""

    def traced(*args):
        _tracing.active = True
        try:
            return function(*args)
        finally:
            _tracing.active = False

    compiled = tf.function(traced, jit_compile=True, autograph=False)

    def call(*args):
        global calls
        calls += 1
        return compiled(*args)

    call.__doc__ = function.__doc__
    return call


def _divisor(count) -> tf.Tensor:
    """``count`` as the float32 tensor a compiled function divides by."""
    return tf.constant(count, tf.float32)


def _unbounded() -> tf.Tensor:
    """+inf, the bound of ``_compensate``'s product."""
    return tf.constant(float("inf"), tf.float32)


def _compensate(vector, residual, lr_ratio, unbounded):
    """``ErrorFeedback.compensate``: p = vector + residual * lr_ratio, rounded twice as the
    ops round it. XLA would contract the product and the sum into one fused multiply-add;
    the minimum with ``unbounded`` (+inf, an argument, so that XLA cannot drop it) leaves no
    product feeding the sum."""
    if residual is None:
        return vector
    return vector + tf.minimum(residual * lr_ratio, unbounded)


def _encode(codec, exchange, p, scale, key, feedback, one):
    """The payload of ``codec.encode`` of p as ``exchange`` sends it, and with ``feedback``
    the residual p - decode(values(codes), scale, 1)."""
    draws = seeding.uniforms(key, p.shape[0]) if codec.stochastic else None
    codes = codec.encode(p, scale, draws)
    payload = exchange.packed(codes)
    if not feedback:
        return payload, None
    return payload, p - codec.decode(codec.values(codes), scale, one)


@_compiled
def _local_scale(codec, grad):
    return codec.local_scale(grad)


def local_scale(codec, grad: tf.Tensor) -> tf.Tensor:
    """``codec.local_scale``."""
    return _local_scale(codec, grad)


@_compiled
def _compensated_scale(codec, vector, residual, lr_ratio, unbounded):
    p = _compensate(vector, residual, lr_ratio, unbounded)
    return p, codec.local_scale(p)


def compensated_scale(codec, vector: tf.Tensor, residual, lr_ratio) -> tuple:
    """``ErrorFeedback.compensate`` and ``codec.local_scale``: (p, scale)."""
    return _compensated_scale(codec, vector, residual, _float(lr_ratio), _unbounded())


@_compiled
def _compensated_encode(codec, exchange, vector, residual, lr_ratio, unbounded, key, feedback, one):
    p = _compensate(vector, residual, lr_ratio, unbounded)
    scale = codec.local_scale(p)
    payload, kept = _encode(codec, exchange, p, scale, key, feedback, one)
    return payload, scale, kept


def compensated_encode(codec, exchange, vector, residual, lr_ratio, key, feedback) -> tuple:
    """``compensated_scale`` then ``encode``, one compiled function: (payload, scale,
    residual or None)."""
    return _compensated_encode(
        codec,
        exchange,
        vector,
        residual,
        _float(lr_ratio),
        _unbounded(),
        key,
        feedback,
        _divisor(1),
    )


@_compiled
def _encoded(codec, exchange, p, scale, key, feedback, one):
    return _encode(codec, exchange, p, scale, key, feedback, one)


def encode(codec, exchange, p: tf.Tensor, scale: tf.Tensor, key: tf.Tensor, feedback: bool):
    """``codec.encode`` of p under ``scale`` as ``exchange`` sends it, and with ``feedback``
    the residual: (payload, residual or None). ef-sign's are ``signs_with_feedback``."""
    if isinstance(codec, BlockSign):
        return signs_with_feedback(codec, p, scale)
    return _encoded(codec, exchange, p, scale, key, feedback, _divisor(1))


@_compiled
def _signs_with_feedback(codec, p, scale, one):
    codes = codec.encode(p, None, None)
    packed = tf.reshape(pack(codes[None], SignCodes()), [-1])
    return packed, p - codec.decode(codec.values(codes), scale, one)


def signs_with_feedback(codec, p: tf.Tensor, scale: tf.Tensor) -> tuple:
    """``BlockSign.encode``, packing, and the residual: (packed signs, residual)."""
    return _signs_with_feedback(codec, p, scale, _divisor(1))


@_compiled
def _server_step(codec, messages, head, block, numel, previous, lr_ratio, unbounded, count, one):
    scales = float_rows(messages[:, :head])[:, block : block + 1]
    signs = unpack(messages[:, head:], codec.code_space, numel)
    average = divide(tf.reduce_sum(tf.cast(signs, tf.float32) * scales, axis=0), count)
    compensated = _compensate(average, previous, lr_ratio, unbounded)
    scale = codec.local_scale(compensated)
    codes = codec.encode(compensated, scale, None)
    residual = compensated - codec.decode(codec.values(codes), scale, one)
    return tf.reshape(pack(codes[None], codec.code_space), [-1]), scale, residual


def server_step(server, codec, messages, head: int, block: int, count: int, numel: int):
    """``ServerStep`` of a server whose workers each sent a message (row of ``messages``:
    ``head`` bytes of float32 block scales, then the server's ``numel`` packed signs, all in
    scale block ``block``). Returns (packed signs, scale) and proposes the new server
    residual."""
    packed, scale, residual = _server_step(
        codec,
        messages,
        head,
        block,
        numel,
        server.memory.residuals[server.key],
        _float(server.lr_ratio),
        _unbounded(),
        _divisor(count),
        _divisor(1),
    )
    server.memory.propose(server.key, residual)
    return packed, scale


@_compiled
def _scaled_signs(bits, scales, numel):
    signs = unpack(bits, SignCodes(), numel)
    return tf.cast(signs, tf.float32) * tf.reshape(scales, [-1, 1])


def scaled_signs(bits: tf.Tensor, scales: tf.Tensor, numel: int) -> tf.Tensor:
    """The first ``numel`` signs of each row of ``bits`` times that row's scale."""
    return _scaled_signs(bits, scales, numel)


_decoded_totals = _compiled(decoding.decoded_totals)


def decoded_totals(codec, total: tf.Tensor, scale: tf.Tensor, count: int) -> tf.Tensor:
    """``codec.decode`` of the allreduce's summed values ``total``."""
    return _decoded_totals(codec, total, scale, _divisor(count))


# No divisor: the sharded exchange's partial sum is the call as it stands.
summed_codes = _compiled(decoding.summed_codes)


_decoded_sums = _compiled(decoding.decoded_sums)


def decoded_sums(codec, rows: tf.Tensor, scale: tf.Tensor, count: int, numel: int) -> tf.Tensor:
    """The allgather's ``codec.decode`` of the sum over the rows' values, shared scale."""
    return _decoded_sums(codec, rows, scale, _divisor(count), numel)


@_compiled
def _decoded_own_scales(codec, messages, head, count, numel):
    # Row by row, in rank order as the ops' sum adds them: XLA fuses each row's unpacking
    # and decoding into the sum, where decoding every row first would hold N decoded rows.
    total = None
    for row in tf.unstack(messages):
        values = codec.values(unpack(row[head:], codec.code_space, numel))
        decoded = codec.decode(values, float_rows(row[None, :head])[0], count)
        total = decoded if total is None else total + decoded
    return total


def decoded_own_scales(codec, messages: tf.Tensor, head: int, count: int, numel: int):
    """The allgather's sum over the workers' ``messages`` (``head`` bytes of float32
    scales, then the codes) of ``codec.decode`` of their values under their own scales."""
    return _decoded_own_scales(codec, messages, head, _divisor(count), numel)


_decoded_segments = _compiled(decoding.decoded_segments)


def decoded_segments(codec, rows, total_space, length: int, scale, count: int, numel: int):
    """The sharded exchange's ``codec.decode`` of the gathered partial sums."""
    return _decoded_segments(codec, rows, total_space, length, scale, _divisor(count), numel)


def _float(value) -> tf.Tensor:
    """A learning-rate ratio (a number or a tensor) as a float32 tensor, so that a new value
    does not trace the compiled function again."""
    return tf.cast(value, tf.float32)
