"""The codecs' per-element passes on CPU tensors, fused by ``hvd_compress.kernels``:
ef-sign's worker and server, and TernGrad's and the fixed-width QSGD family's scales,
encoding (with the draws of ``seeding.uniforms``, packing and residual) and decoding.
Mirrors ``hvd_compress.pt.fused``.

Each call is one ``tf.numpy_function`` around ``hvd_compress.fused``'s call of a kernel,
so it runs inside the pipeline's ``tf.function`` graphs as well as eagerly; the kernels
release the GIL. The codec, memory and exchange ops (``BlockSign``, ``TernGrad``,
``QSGD``, ..., ``ErrorFeedback``, ``ServerStep``, ``tf.exchange``) define the step and are
what GPU tensors run; on CPU float32 tensors these calls give the same codes, packed
bytes, decoded values and residuals bit for bit, in a few passes where the graph's ops
make one pass each.

Tensors on a GPU take the same calls compiled by XLA (``xla_fused``): the ops themselves,
fused on the device. ``HVD_COMPRESS_KERNELS=0`` in the environment keeps the ops uncompiled
everywhere, to compare; ``HVD_COMPRESS_KERNELS=xla`` sends CPU tensors down the device path
instead of to the numba kernels.
"""

import tensorflow as tf

from hvd_compress import fused as core
from hvd_compress.blocksign import BlockSign

from . import xla_fused

# Whether the kernels run at all (tests and benchmarks switch it to compare).
ENABLED = core.AVAILABLE

# The functions that build a call, and with them the functions the call runs, stay as
# written: inside the pipeline's ``tf.function`` autograph would convert them, and each call
# would then run the converted code, whose every conditional expression and call goes
# through autograph's checks at run time (most of a call's Python time).
_unconverted = tf.autograph.experimental.do_not_convert


def _on_cpu(tensor) -> bool:
    """Whether ``tensor`` is on the CPU: placed there, or unplaced (in a graph, or a Keras 3
    variable, which names no device) on a machine without a GPU."""
    device = (getattr(tensor, "device", None) or "").upper()
    if "GPU" in device:
        return False
    return "CPU" in device or not tf.config.list_logical_devices("GPU")


def applies(codec, tensor) -> bool:
    """Whether ``codec``'s work on tensors like ``tensor`` goes through these calls: float32
    tensors of ``BlockSign``, ``TernGrad`` and the QSGD family's fixed width, to the CPU
    kernels (``on_host``) or compiled by XLA (``xla_fused.applies``)."""
    return tensor.dtype == tf.float32 and (
        on_host(codec, tensor) or xla_fused.applies(codec, _on_cpu(tensor))
    )


def on_host(codec, tensor) -> bool:
    """Whether the CPU kernels take ``codec``'s work on tensors like ``tensor``: CPU float32
    tensors of the codecs ``applies`` names, with the kernels on and not standing in for
    the device path. Only they take the worker momentum's step (``WorkerMomentum.Deferred``)."""
    return (
        ENABLED
        and not xla_fused.ON_CPU
        and tensor.dtype == tf.float32
        and core.covers(codec)
        and _on_cpu(tensor)
    )


def _compiles(tensor) -> bool:
    """Whether a call on ``tensor`` that ``applies`` goes to the compiled functions."""
    return xla_fused.ON_CPU or not _on_cpu(tensor)


def _call(function, inputs, outputs):
    """``function`` of the arrays of ``inputs``, as tensors of ``outputs`` (TensorSpecs)."""
    results = tf.numpy_function(function, inputs, [spec.dtype for spec in outputs], stateful=False)
    if not isinstance(results, list):  # eagerly, a single output comes alone
        results = [results]
    for result, spec in zip(results, outputs):
        result.set_shape(spec.shape)
    return results


def _floats(numel):
    return tf.TensorSpec([numel], tf.float32)


def _scales(codec, numel):
    """The spec of ``codec``'s local scales of ``numel`` elements, one per bucket."""
    return _floats(codec.buckets(numel))


def _signs(numel):
    """The spec of ``numel`` packed signs."""
    return tf.TensorSpec([-(-numel // 8)], tf.uint8)


@_unconverted
def local_scale(codec, grad: tf.Tensor) -> tf.Tensor:
    """``TernGrad.local_scale`` or the QSGD family's (``hvd_compress.fused.local_scale``)."""
    if _compiles(grad):
        return xla_fused.local_scale(codec, grad)
    g = tf.reshape(grad, [-1])
    (scale,) = _call(lambda g: (core.local_scale(codec, g),), [g], [_scales(codec, g.shape[0])])
    return scale


@_unconverted
def _worker_state(numel, residual, momentum):
    """What the worker's calls take after the vector and the lr_ratio: the tensors (the
    residual, the momentum buffer, where given), and the function of their arrays that
    gives the residual (or None) and ``hvd_compress.fused``'s momentum step (or None)."""
    tensors = [] if residual is None else [residual]
    if momentum is not None:
        tensors.append(tf.reshape(momentum.buffer, [-1]))

    def arrays(values):
        values = list(values)
        residual_array = None if residual is None else values.pop(0)
        if momentum is None:
            return residual_array, None
        factor = core.momentum_factor(momentum.mu, rounded_per_op=True)
        return residual_array, (values.pop(0), factor, momentum.nesterov, core.empty(numel))

    return tensors, arrays


def _buffer_spec(momentum, numel):
    """The spec of a call's new momentum buffer, its last output: none without one."""
    return [] if momentum is None else [_floats(numel)]


def _set_buffer(momentum, results):
    """Makes a call's last output the new buffer of its ``momentum``, if any."""
    if momentum is not None:
        momentum.out = tf.reshape(results[-1], tf.shape(momentum.buffer))


@_unconverted
def compensated_scale(codec, vector: tf.Tensor, residual, lr_ratio, momentum=None) -> tuple:
    """``ErrorFeedback.compensate`` and ``codec.local_scale`` (``hvd_compress.fused``):
    (p, scale), p = u + residual * lr_ratio (``lr_ratio`` may be a tensor). u is ``vector``, or
    with a ``momentum`` (``WorkerMomentum.Deferred``) its direction, whose new buffer
    becomes ``momentum.out`` in the same pass. Without either, p is ``vector`` itself."""
    if _compiles(vector):
        return xla_fused.compensated_scale(codec, vector, residual, lr_ratio)
    numel = vector.shape[0]
    if residual is None and momentum is None:
        (scale,) = _call(
            lambda v: (core.compensated_scale(codec, v, None, 1.0)[1],),
            [vector],
            [_scales(codec, numel)],
        )
        return vector, scale
    state, arrays = _worker_state(numel, residual, momentum)

    def run(vector, lr_ratio, *values):
        residual, step = arrays(values)
        p, scale = core.compensated_scale(codec, vector, residual, float(lr_ratio), step)
        return [p, scale] + ([] if step is None else [step[3]])

    results = _call(
        run,
        [vector, tf.cast(lr_ratio, tf.float32), *state],
        [_floats(numel), _scales(codec, numel)] + _buffer_spec(momentum, numel),
    )
    _set_buffer(momentum, results)
    return results[0], results[1]


@_unconverted
def compensated_encode(
    codec,
    exchange,
    vector: tf.Tensor,
    residual,
    lr_ratio,
    key: tf.Tensor,
    feedback: bool,
    momentum=None,
) -> tuple:
    """``compensated_scale`` then ``encode`` in one call, for a scale that no collective
    shares between them: (payload, scale, residual or None). p never becomes a tensor:
    TensorFlow frees an array it adopted only when it next hands Python the GIL, so each
    tensor's p would take memory of its own, touched page by page, where within the call
    the next one reuses it."""
    if _compiles(vector):
        return xla_fused.compensated_encode(
            codec, exchange, vector, residual, lr_ratio, key, feedback
        )
    numel = vector.shape[0]
    spec = exchange.payload()
    state, arrays = _worker_state(numel, residual, momentum)

    def run(vector, lr_ratio, key, *values):
        residual, step = arrays(values)
        payload, scale, kept = core.compensated_encode(
            codec,
            vector,
            residual,
            float(lr_ratio),
            step,
            int(key),
            core.empty(spec.shape, spec.dtype.as_numpy_dtype),
            feedback,
        )
        kept = [kept] if feedback else []
        return [payload, scale, *kept] + ([] if step is None else [step[3]])

    outputs = [spec, _scales(codec, numel), *([_floats(numel)] if feedback else [])]
    results = _call(
        run,
        [vector, tf.cast(lr_ratio, tf.float32), key, *state],
        outputs + _buffer_spec(momentum, numel),
    )
    _set_buffer(momentum, results)
    return results[0], results[1], results[2] if feedback else None


@_unconverted
def signs_with_feedback(codec, p: tf.Tensor, scale: tf.Tensor) -> tuple:
    """``BlockSign.encode``, packing, and the residual p - decode(codes) that
    ``ErrorFeedback.update`` keeps, in one pass: (packed signs, residual)."""
    if _compiles(p):
        return xla_fused.signs_with_feedback(codec, p, scale)
    numel = p.shape[0]
    return _call(
        lambda p, scale: core.signs_with_feedback(codec, p, scale),
        [p, scale],
        [_signs(numel), _floats(numel)],
    )


@_unconverted
def server_step(server, codec, messages: tf.Tensor, head: int, block: int, count: int, numel: int):
    """``ServerStep`` of a server (of one shard, or replicated over a whole tensor) whose
    workers each sent a message (row of ``messages``: ``head`` bytes of float32 block
    scales, then the server's ``numel`` packed signs, all in scale block ``block``): the
    average, the server residual and the second compression. Returns (packed signs,
    scale) and proposes the new server residual."""
    if _compiles(messages):
        return xla_fused.server_step(server, codec, messages, head, block, count, numel)
    previous = server.memory.residuals[server.key]

    def run(messages, previous, lr_ratio):
        return core.server_step(
            codec, messages, head, block, count, previous, float(lr_ratio), numel
        )

    packed, scale, residual = _call(
        run,
        [messages, previous, tf.cast(server.lr_ratio, tf.float32)],
        [_signs(numel), _floats(codec.buckets(numel)), _floats(numel)],
    )
    server.memory.propose(server.key, residual)
    return packed, scale


@_unconverted
def scaled_signs(bits: tf.Tensor, scales: tf.Tensor, numel: int) -> tf.Tensor:
    """``packing.unpack_scaled_signs``: the first ``numel`` signs of each row of ``bits``
    times that row's scale, as float32 rows."""
    if _compiles(bits):
        return xla_fused.scaled_signs(bits, scales, numel)
    (out,) = _call(
        lambda bits, scales: (core.scaled_signs(bits, scales, numel),),
        [bits, scales],
        [tf.TensorSpec([bits.shape[0], numel], tf.float32)],
    )
    return out


@_unconverted
def encode(codec, exchange, p: tf.Tensor, scale: tf.Tensor, key: tf.Tensor, feedback: bool):
    """``codec.encode`` of p under ``scale`` with the draws of stream ``key`` (an int64
    tensor), written as ``exchange`` sends it (its ``payload``: packed codes, or values in
    the allreduce's carrier), and with ``feedback`` the residual
    p - decode(values(codes), scale, 1) of ``ErrorFeedback.update``, in one pass:
    (payload, residual or None). ef-sign's are ``signs_with_feedback``."""
    if _compiles(p):
        return xla_fused.encode(codec, exchange, p, scale, key, feedback)
    if isinstance(codec, BlockSign):
        return signs_with_feedback(codec, p, scale)
    spec = exchange.payload()

    def run(p, scale, key):
        payload = core.empty(spec.shape, spec.dtype.as_numpy_dtype)
        residual = core.empty(p.shape) if feedback else None
        payload = core.encode(codec, p, scale, int(key), payload, residual)
        return (payload, residual) if feedback else (payload,)

    outputs = [spec, _floats(p.shape[0])] if feedback else [spec]
    results = _call(run, [p, scale, key], outputs)
    return results[0], results[1] if feedback else None


@_unconverted
def decoded_totals(codec, total: tf.Tensor, scale: tf.Tensor, count: int) -> tf.Tensor:
    """``codec.decode`` of the allreduce's summed values ``total``."""
    if _compiles(total):
        return xla_fused.decoded_totals(codec, total, scale, count)
    (out,) = _call(
        lambda total, scale: (core.decoded_totals(codec, total, scale, count),),
        [total, scale],
        [_floats(total.shape[0])],
    )
    return out


@_unconverted
def summed_codes(codec, rows: tf.Tensor, length: int, total_space) -> tf.Tensor:
    """The sharded exchange's partial sum: the values of the first ``length`` codes of
    every row, summed over the rows and packed in ``total_space``."""
    if _compiles(rows):
        return xla_fused.summed_codes(codec, rows, length, total_space)
    (out,) = _call(
        lambda rows: (core.summed_codes(codec, rows, length, total_space),),
        [rows],
        [tf.TensorSpec([total_space.packed_nbytes(length)], tf.uint8)],
    )
    return out


@_unconverted
def decoded_sums(codec, rows: tf.Tensor, scale: tf.Tensor, count: int, numel: int) -> tf.Tensor:
    """The allgather's ``codec.decode`` of the sum over the rows' values, shared scale."""
    if _compiles(rows):
        return xla_fused.decoded_sums(codec, rows, scale, count, numel)
    (out,) = _call(
        lambda rows, scale: (core.decoded_sums(codec, rows, scale, count, numel),),
        [rows, scale],
        [_floats(numel)],
    )
    return out


@_unconverted
def decoded_own_scales(codec, messages: tf.Tensor, head: int, count: int, numel: int) -> tf.Tensor:
    """The allgather's sum over the workers' ``messages`` (rows: ``head`` bytes of float32
    scales, then the codes) of ``codec.decode`` of their values, each under its own scales."""
    if _compiles(messages):
        return xla_fused.decoded_own_scales(codec, messages, head, count, numel)
    (out,) = _call(
        lambda messages: (core.decoded_own_scales(codec, messages, head, count, numel),),
        [messages],
        [_floats(numel)],
    )
    return out


@_unconverted
def decoded_segments(
    codec, rows: tf.Tensor, total_space, length: int, scale: tf.Tensor, count: int, numel: int
) -> tf.Tensor:
    """The sharded exchange's ``codec.decode`` of the gathered partial sums: row r is
    elements r length .. (r + 1) length - 1, packed in ``total_space``."""
    if _compiles(rows):
        return xla_fused.decoded_segments(codec, rows, total_space, length, scale, count, numel)
    (out,) = _call(
        lambda rows, scale: (
            core.decoded_segments(codec, rows, total_space, length, scale, count, numel),
        ),
        [rows, scale],
        [_floats(numel)],
    )
    return out
