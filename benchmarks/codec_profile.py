"""Where a codec's own time goes on one worker: each stage of a step of the synthetic
ResNet-50's gradients, timed on one thread with no network, and each codec's encoding and
decoding as eager ops and as the fused CPU kernels (``hvd_compress.pt.fused``), against one
copy of the gradients.

Times are the thread's CPU time (``time.thread_time``), not wall time, so that other jobs
sharing the machine's cores do not count (they still slow the caches down somewhat).

    OMP_NUM_THREADS=1 python -m benchmarks.codec_profile [--codecs terngrad,qsgd-inf,nuqsgd,ef-sign]

Stages of the eager ops, summed over the tensors the codec compresses (the others are sent
whole): the scale (``local_scale``), the random draws of stochastic codecs, ``encode``,
packing the codes, and on the receiving side unpacking one worker's worth of codes,
``values`` and ``decode``. A sharded exchange unpacks twice (the shards, then the summed
shards) and packs the sums; an allgather unpacks N rows: multiply the receiving stages
accordingly.

Encode + decode: the same work, one worker's codes decoded, as the eager ops and as the
kernels do it; for ef-sign the worker's momentum, compensation, signs and residual and its
decode of the servers' signs, and separately the server of one shard of every tensor (N =
4), as ``benchmarks.kernel_profile`` times them. The copy is ``torch.empty_like`` and
``copy_`` of all compressed gradients in one tensor, timed in the same run: the least that
a pass writing a new tensor costs.

ef-sign's worker is also timed against its memory streams alone: loops that read and write
exactly the arrays its kernels do (the gradient, momentum buffer and residual in; the new
buffer and p out; p read and written over; the decoded signs out), with no arithmetic
beyond an add: the least its passes can cost on the host, whatever the kernels compute;
and without the rewrite of p (the residual's pass), what keeping the residual as p and its
scales would leave.
"""

import argparse
import contextlib
import time

import numba
import numpy as np
import torch

import hvd_compress.pt as hc
from hvd_compress import fused as fused_core
from hvd_compress.pt import fused, seeding
from hvd_compress.pt.exchange import Meter, make_exchange
from hvd_compress.pt.packing import pack, unpack, unpack_scaled_signs
from hvd_compress.registry import resolve
from hvd_compress.server import ServerStep

from .kernel_profile import MU, eager_server, eager_worker, fused_server, fused_worker
from .models import SyntheticResNet50
from .profiling import compressed_shapes, interleaved_best_seconds, server_messages

STAGES = ("scale", "random draws", "encode", "pack", "unpack", "values", "decode")
KEY = 12345  # the stream of every tensor's draws: their values do not change the time


@contextlib.contextmanager
def eager_ops():
    """The codecs' eager ops, also where the kernels would apply."""
    enabled, fused.ENABLED = fused.ENABLED, False
    try:
        yield
    finally:
        fused.ENABLED = enabled


def profile(codec, grads, repeats=2):
    """Seconds per stage of the eager ops (best of ``repeats``) for ``grads``."""
    best = dict.fromkeys(STAGES, float("inf"))
    for _ in range(repeats):
        spent = dict.fromkeys(STAGES, 0.0)

        def timed(stage, function, *args):
            start = time.thread_time()
            out = function(*args)
            spent[stage] += time.thread_time() - start
            return out

        with eager_ops():
            for grad in grads:
                scale = timed("scale", codec.local_scale, grad)
                uniforms = (
                    timed("random draws", seeding.uniforms, KEY, grad.numel(), grad.device)
                    if codec.stochastic
                    else None
                )
                codes = timed("encode", codec.encode, grad, scale, uniforms)
                packed = timed("pack", pack, codes.reshape(1, -1), codec.code_space)
                received = timed("unpack", unpack, packed, codec.code_space, grad.numel())
                values = timed("values", codec.values, received)
                timed("decode", codec.decode, values, scale, 1)
        best = {stage: min(best[stage], spent[stage]) for stage in STAGES}
    return best


def _eager_quantizer(codec, grad):
    """Encoding and decoding as the eager pipeline and exchange do it."""
    scale = codec.local_scale(grad)
    codes = codec.encode(grad, scale, seeding.uniforms(KEY, grad.numel(), grad.device))
    packed = pack(codes.reshape(1, -1), codec.code_space)
    return codec.decode(codec.values(unpack(packed, codec.code_space, grad.numel())), scale, 1)


def _fused_quantizer(codec, grad):
    """The same through the kernels, as the pipeline's allgather calls them: the QSGD
    family's own scales taken in the encoding's pass."""
    exchange = make_exchange("allgather", codec, grad.numel(), 1, Meter(), 1)
    if fused.scales_in_encode(codec, grad.numel()):
        packed, _, scale = fused.scaled_encode(codec, exchange, grad, KEY, feedback=False)
    else:
        scale = codec.local_scale(grad)
        packed, _ = fused.encode(codec, exchange, grad, scale, KEY, feedback=False)
    return fused.decoded_sums(codec, packed.reshape(1, -1), scale, 1, grad.numel())


def _sign_inputs(grads):
    """ef-sign's inputs for ``grads``: per tensor the worker's (gradient, momentum buffer,
    residual), the 4 servers' (sign bits of a quarter of the tensor each, one scale each)
    that the worker decodes, and one server's (4 workers' messages of its shard, its
    residual)."""
    generator = torch.Generator().manual_seed(1)
    workers = [
        (
            grad,
            torch.randn(grad.shape, generator=generator),
            torch.randn(grad.shape, generator=generator),
        )
        for grad in grads
    ]
    shards = [
        (torch.randint(0, 256, (4, -(-grad.numel() // 32)), dtype=torch.uint8), torch.rand(4, 1))
        for grad in grads
    ]
    servers = [
        (server_messages(bits, scales), torch.randn(bits.shape[1] * 8, generator=generator))
        for bits, scales in shards
    ]
    return workers, shards, servers


def encode_decode(codec, grads, signs, repeats=3):
    """[(label, eager seconds, kernel seconds, copy seconds)] of encoding and decoding
    ``grads``, in turn with a copy of them (``copy``); ef-sign's over ``signs``, the
    ``_sign_inputs`` of ``grads``."""
    copy = _copy(grads)
    if codec.name != "ef-sign":

        def run(step):
            return lambda: [step(codec, grad) for grad in grads]

        def eager():
            with eager_ops():
                run(_eager_quantizer)()

        return [
            (codec.name, *interleaved_best_seconds([eager, run(_fused_quantizer), copy], repeats))
        ]

    workers, shards, servers = signs
    rows = [
        (
            "ef-sign worker",
            _worker(codec, eager_worker, unpack_scaled_signs, workers, shards),
            _worker(codec, fused_worker, fused.scaled_signs, workers, shards),
        ),
        (
            "ef-sign server (N = 4)",
            lambda: [eager_server(codec, *s) for s in servers],
            lambda: [fused_server(codec, *s) for s in servers],
        ),
    ]
    return [
        (label, *interleaved_best_seconds([eager, kernels, copy], repeats))
        for label, eager, kernels in rows
    ]


@numba.njit(nogil=True)
def _compensation_streams(grad, buffer, residual, new_buffer, p):
    for i in range(grad.size):
        new_buffer[i] = grad[i] + buffer[i]
        p[i] = grad[i] + residual[i]


@numba.njit(nogil=True)
def _rewrite_streams(p):
    for i in range(p.size):
        p[i] = p[i] + np.float32(1.0)


@numba.njit(nogil=True)
def _decode_streams(bits, out):
    for i in range(out.size):
        out[i] = np.float32(bits[i >> 3])


def _worker(codec, step, decode, workers, shards):
    """ef-sign's worker over ``_sign_inputs``' ``workers`` and ``shards``: ``step`` of each
    tensor (``kernel_profile``'s eager or fused worker) and ``decode`` of its servers'
    signs."""
    return lambda: (
        [step(codec, *w) for w in workers],
        [decode(bits, scales, bits.shape[1] * 8) for bits, scales in shards],
    )


def _worker_streams(workers, shards, rewrite=True):
    """ef-sign's worker streams (the module's docstring) over ``_sign_inputs``' arrays, as
    its kernels move them: new arrays for the new buffer, p and the decoded signs, p
    rewritten in place unless not ``rewrite`` (a residual kept as p and its scales, to be
    subtracted in the next compensation, would not rewrite it)."""
    arrays = [tuple(t.numpy() for t in w) for w in workers]
    rows = [bits.numpy().reshape(-1) for bits, _ in shards]

    def run():
        for (grad, buffer, residual), bits in zip(arrays, rows):
            p = fused_core.empty(grad.size)
            _compensation_streams(grad, buffer, residual, fused_core.empty(grad.size), p)
            if rewrite:
                _rewrite_streams(p)
            _decode_streams(bits, fused_core.empty(bits.size * 8))

    return run


def worker_streams(codec, grads, signs, repeats=3):
    """(kernel seconds, streams seconds, streams seconds without the rewrite of p, copy
    seconds) of ef-sign's worker with its kernels, of its memory streams alone and of a
    copy of ``grads``, timed in turn over ``signs``, the ``_sign_inputs`` of ``grads``."""

    workers, shards, _ = signs
    return interleaved_best_seconds(
        [
            _worker(codec, fused_worker, fused.scaled_signs, workers, shards),
            _worker_streams(workers, shards),
            _worker_streams(workers, shards, rewrite=False),
            _copy(grads),
        ],
        repeats,
    )


def _copy(grads):
    """One copy of ``grads`` in one tensor (``empty_like`` + ``copy_``): the least that a
    pass writing a new tensor costs."""
    flat = torch.cat(grads)
    return lambda: torch.empty_like(flat).copy_(flat)


def _tensorflow_quantizer(codec, key):
    """``_eager_quantizer`` / ``_fused_quantizer`` in the TensorFlow port, for a
    ``tf.function``: through ``hvd_compress.tf.fused`` where its ``applies`` holds
    (``fused.ENABLED``), else through the codec's TensorFlow ops."""
    from hvd_compress.tf import fused as tf_fused
    from hvd_compress.tf import seeding as tf_seeding
    from hvd_compress.tf.exchange import Meter as TFMeter
    from hvd_compress.tf.exchange import make_exchange as tf_make_exchange
    from hvd_compress.tf.packing import pack as tf_pack
    from hvd_compress.tf.packing import unpack as tf_unpack

    def step(grad):
        numel = grad.shape[0]
        exchange = tf_make_exchange("allgather", codec, numel, 1, TFMeter(), 1)
        if tf_fused.applies(codec, grad):
            # One call, as the pipeline encodes where no collective shares the scale.
            payload, scale, _ = tf_fused.compensated_encode(
                codec, exchange, grad, None, 1.0, key, False
            )
            return tf_fused.decoded_sums(codec, payload[None], scale, 1, numel)
        scale = codec.local_scale(grad)
        codes = codec.encode(grad, scale, tf_seeding.uniforms(key, numel))
        packed = tf_pack(codes[None], codec.code_space)
        return codec.decode(codec.values(tf_unpack(packed, codec.code_space, numel)), scale, 1)

    return step


def _tensorflow_signs(codec):
    """ef-sign's worker (its momentum, then the pipeline's compensation, scales, signs and
    residual, as ``hvd_compress.tf.momentum`` and the pipeline run them, and the decoding
    of the servers' signs) and one server's step, for ``tf.function``\\ s: through
    ``hvd_compress.tf.fused`` where its ``applies`` holds, else through the ops."""
    import tensorflow as tf

    from hvd_compress.codes import SignCodes
    from hvd_compress.tf import fused as tf_fused
    from hvd_compress.tf.exchange import Allgather as TFAllgather
    from hvd_compress.tf.exchange import Meter as TFMeter
    from hvd_compress.tf.memory import ErrorFeedback as TFErrorFeedback
    from hvd_compress.tf.momentum import WorkerMomentum
    from hvd_compress.tf.packing import pack as tf_pack
    from hvd_compress.tf.packing import unpack as tf_unpack

    def decode_signs(bits, scales):
        numel = bits.shape[1] * 8
        if tf_fused.applies(codec, scales):
            return tf_fused.scaled_signs(bits, scales[:, 0], numel)
        signs = tf.cast(tf_unpack(bits, SignCodes(), numel), tf.float32)
        return codec.decode(signs, scales, 1)

    def worker(grad, buffer, residual, bits, scales):
        if tf_fused.applies(codec, grad):
            step = WorkerMomentum.Deferred(buffer, MU, True)
            exchange = TFAllgather(codec, grad.shape[0], 1, TFMeter(), 1)
            packed, _, kept = tf_fused.compensated_encode(
                codec, exchange, grad, residual, 1.0, tf.constant(KEY, tf.int64), True, step
            )
            return step.out, packed, kept, decode_signs(bits, scales)
        m = buffer * MU + grad
        u = grad + m * MU
        p = u + residual * 1.0
        scale = codec.local_scale(p)
        codes = codec.encode(p, scale, None)
        kept = p - codec.decode(codec.values(codes), scale, 1)
        packed = tf_pack(codes[None], SignCodes())
        return m, packed, kept, decode_signs(bits, scales)

    def server(messages, residual):
        memory = TFErrorFeedback({})
        memory.residuals["s"] = residual
        step = ServerStep(memory, "s")
        numel = residual.shape[0]
        if tf_fused.applies(codec, residual):
            packed, _ = tf_fused.server_step(step, codec, messages, 4, 0, 4, numel)
            return packed
        scales = tf.bitcast(tf.reshape(messages[:, :4], [4, 1, 4]), tf.float32)
        bits = messages[:, 4:]
        signs = tf.cast(tf_unpack(bits, SignCodes(), numel), tf.float32)
        codes, _, _ = step(codec, tf.reduce_sum(signs * scales, axis=0) / 4)
        return tf_pack(codes[None], SignCodes())

    return worker, server


def _graph(step, args):
    """A ``tf.function`` of ``step`` over every tensor's ``args``, captured as a pipeline's
    graph captures its gradients (not bound as the function's inputs)."""
    import tensorflow as tf

    return tf.function(lambda: [step(*a) for a in args])


def tensorflow_encode_decode(name, grads, signs, repeats=7):
    """[(label, PyTorch kernels, TensorFlow kernels, TensorFlow ops)]: wall seconds of
    encoding and decoding ``grads`` (ef-sign's over ``signs``) as ``encode_decode``'s rows,
    TensorFlow's as one ``tf.function`` over all tensors, as its pipeline runs a step.
    TensorFlow runs its graphs on threads of its own, whose time ``time.thread_time``
    would not see: all three are wall times of the same run, so that their ratios hold,
    each the best of ``repeats``: TensorFlow frees the arrays its graph adopted late, so a
    run's time depends on the heap's state, and the best of 3 swung by a factor of 1.5."""
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf import fused as tf_fused

    codec = resolve(name, htf.CODECS)
    torch_codec = resolve(name, hc.CODECS)

    def tensors(arrays):
        return [tf.constant(a.numpy()) for a in arrays]

    if name == "ef-sign":
        workers, shards, servers = signs
        torch_rows = [
            _worker(torch_codec, fused_worker, fused.scaled_signs, workers, shards),
            lambda: [fused_server(torch_codec, *s) for s in servers],
        ]
        inputs = [
            [tensors(w) + tensors(s) for w, s in zip(workers, shards)],
            [tensors(s) for s in servers],
        ]
        labels = ["ef-sign worker", "ef-sign server (N = 4)"]
        steps = _tensorflow_signs(codec)
    else:
        torch_rows = [lambda: [_fused_quantizer(torch_codec, grad) for grad in grads]]
        inputs = [[tensors([grad]) for grad in grads]]
        labels = [name]
        steps = [_tensorflow_quantizer(codec, tf.constant(KEY, tf.int64))]

    def traced():
        """Each row's steps over all tensors in one graph, traced (the kernels or the ops,
        as ``tf_fused.ENABLED`` is now)."""
        graphs = [_graph(step, args) for step, args in zip(steps, inputs)]
        for graph in graphs:
            graph.get_concrete_function()
        return [lambda graph=graph: tf.nest.map_structure(np.asarray, graph()) for graph in graphs]

    kernels = traced()
    enabled, tf_fused.ENABLED = tf_fused.ENABLED, False
    try:
        ops = traced()
    finally:
        tf_fused.ENABLED = enabled
    return [
        (label, *interleaved_best_seconds(row, repeats, clock=time.perf_counter))
        for label, *row in zip(labels, torch_rows, kernels, ops)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,nuqsgd,ef-sign")
    parser.add_argument(
        "--no-tensorflow",
        action="store_true",
        help="skip the TensorFlow port's encode + decode beside PyTorch's",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not args.no_tensorflow:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    ports = [
        "| codec | PyTorch kernels (ms) | TensorFlow kernels (ms) | TensorFlow ops (ms) | "
        "TensorFlow / PyTorch |",
        "|---|---|---|---|---|",
    ]
    named = list(SyntheticResNet50().named_parameters())
    stages = [
        "| codec | elements compressed | " + " | ".join(STAGES) + " | total |",
        "|" + "---|" * (len(STAGES) + 3),
    ]
    fusion = [
        "| codec | eager ops (ms) | kernels (ms) | eager / copy | kernels / copy |",
        "|---|---|---|---|---|",
    ]
    copies = []
    floor = None
    for name in args.codecs.split(","):
        codec = resolve(name, hc.CODECS)
        generator = torch.Generator().manual_seed(0)
        grads = [
            torch.randn(shape, generator=generator).reshape(-1)
            for shape in compressed_shapes(codec, named)
        ]
        numel = sum(grad.numel() for grad in grads)
        signs = _sign_inputs(grads) if name == "ef-sign" else None
        seconds = profile(codec, grads)
        stages.append(
            f"| {name} | {numel:,} | "
            + " | ".join(f"{1000 * seconds[s]:.0f}" for s in STAGES)
            + f" | {1000 * sum(seconds.values()):.0f} |"
        )
        for label, eager, kernels, copy in encode_decode(codec, grads, signs):
            copies.append(f"{label}: {numel:,} elements, {1000 * copy:.0f} ms")
            fusion.append(
                f"| {label} | {1000 * eager:.0f} | {1000 * kernels:.0f} | "
                f"{eager / copy:.1f} | {kernels / copy:.1f} |"
            )
        if name == "ef-sign":
            kernels, streams, unrewritten, copy = worker_streams(codec, grads, signs)
            floor = (
                f"ef-sign worker: kernels {1000 * kernels:.0f} ms, its memory streams alone "
                f"{1000 * streams:.0f} ms, a copy {1000 * copy:.0f} ms: the kernels take "
                f"{kernels / streams:.2f} of the streams' time, the streams "
                f"{streams / copy:.2f} copies, {unrewritten / copy:.2f} without the rewrite "
                "of p"
            )
        if not args.no_tensorflow:
            rows = tensorflow_encode_decode(name, grads, signs)
            for label, torch_kernels, tf_kernels, tf_ops in rows:
                ports.append(
                    f"| {label} | {1000 * torch_kernels:.0f} | {1000 * tf_kernels:.0f} | "
                    f"{1000 * tf_ops:.0f} | {tf_kernels / torch_kernels:.2f} |"
                )
    print("CPU milliseconds per step, one thread, eager ops:\n" + "\n".join(stages))
    print("\nOne copy of the compressed gradients (empty_like + copy_): " + "; ".join(copies))
    print("\nEncode + decode of one worker's codes, CPU milliseconds:\n" + "\n".join(fusion))
    if floor:
        print("\n" + floor)
    if len(ports) > 2:
        print(
            "\nThe same in both ports, wall milliseconds (TensorFlow as tf.function graphs, "
            "one thread each):\n" + "\n".join(ports)
        )


if __name__ == "__main__":
    main()
