"""The TensorFlow port's fused CPU kernels (``hvd_compress.tf.fused``) against the
TensorFlow ops they replace, bit for bit: ef-sign's compensation, block scales (equal to
the float64 reference), signs, residual, server step and decoding; TernGrad's and the QSGD
family's scales (equal to the float64 reference), every exchange's payload (packed codes of
full and partial bytes and buckets, the sharded padding, allreduce values), residuals, and
every exchange's receiving side; eagerly and inside ``tf.function``; and a tape loop on 2
ranks that exchanges the same gradients with the kernels as without them, as does ef-sign's
optimizer with the worker momentum the kernels apply.

TensorFlow runs in child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel

pytest.importorskip("numba")

# Every width of codes (2, 4, 8 bits), NUQSGD's exponents, buckets that end inside a byte.
QUANTIZERS = [
    hvd_compress.TernGrad(),
    hvd_compress.TernGrad(clip=0),
    hvd_compress.QSGD(bits=2, bucket_size=7),
    hvd_compress.QSGDInf(),
    hvd_compress.QSGDInf(bits=8, bucket_size=100),
    hvd_compress.NUQSGD(bits=3, bucket_size=9),
    hvd_compress.NUQSGD(bucket_size=2048),
]
LENGTHS = [1, 9, 4097, 100_003]
# The SGD momentum of the worker momentum's cases.
MU = 0.9
BLOCKS = [None, 7, 4096]
# The compiled calls are the ops themselves, so what they can get wrong is XLA's rounding:
# a division, the scales' float64 sums, a product feeding a sum. Fewer cases check it (each
# compiles its functions): each norm and level kind, buckets that end inside a byte.
COMPILED_CASES = (QUANTIZERS[0:1] + QUANTIZERS[2:4] + QUANTIZERS[5:6], [None, 7], [4097])


def _vector(numel, seed, bad=None):
    v = np.random.default_rng(seed).standard_normal(numel).astype(np.float32)
    v[::97] = 0
    if bad is not None:
        v[numel // 2] = bad
    return v


def _codes(space, rows, numel, seed):
    return (
        np.random.default_rng(seed)
        .integers(-space.bound, space.bound + 1, (rows, numel))
        .astype(np.int8 if space.width <= 8 else np.int64)
    )


def _sign_cases(backend, blocks, lengths):
    """Every comparison of ef-sign's calls in ``backend`` (``fused`` or ``xla_fused``) and
    the ops; returns the labels of those that differ."""
    import importlib

    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.codes import SignCodes
    from hvd_compress.server import ServerStep
    from hvd_compress.tf.memory import ErrorFeedback
    from hvd_compress.tf.momentum import WorkerMomentum
    from hvd_compress.tf.packing import pack, unpack

    def accelerated(codec, vector, buffer, residual, lr_ratio, nesterov):
        """The compensation with the worker momentum step of ``nesterov`` (None: none):
        (p, scale, new m or None)."""
        if nesterov is None:
            return (*fused.compensated_scale(codec, vector, residual, lr_ratio), None)
        step = WorkerMomentum.Deferred(buffer, MU, nesterov)
        p, scale = fused.compensated_scale(codec, vector, residual, lr_ratio, step)
        return p, scale, step.out

    fused = importlib.import_module(f"hvd_compress.tf.{backend}")
    differ = []
    traced = {"eager": (accelerated, fused.signs_with_feedback)}
    if backend == "fused":  # a compiled call is a traced function already
        traced["traced"] = (
            tf.function(accelerated, autograph=False),
            tf.function(fused.signs_with_feedback, autograph=False),
        )
    # Only the CPU kernels take the worker momentum's step.
    steps = (None, False, True) if backend == "fused" else (None,)
    for block in blocks:
        codec = htf.BlockSign(block)
        for numel in lengths:
            for bad in (None, float("nan")):
                label = f"block={block} numel={numel} bad={bad}"
                vector = tf.constant(_vector(numel, numel, bad))
                residual = tf.constant(_vector(numel, 1) / 10)
                buffer = tf.constant(_vector(numel, 2))
                for lr_ratio, nesterov in ((1.0, None), (0.3, None), (0.3, False), (0.3, True)):
                    if nesterov not in steps:
                        continue
                    # ``WorkerMomentum.before_exchange``'s ops.
                    u, want_m = vector, None
                    if nesterov is not None:
                        want_m = buffer * MU + vector
                        u = vector + want_m * MU if nesterov else want_m
                    want = u + residual * lr_ratio
                    want_scale = hvd_compress.BlockSign(block).local_scale(want.numpy())
                    want_sent = codec.decode(
                        codec.values(codec.encode(want, None, None)), want_scale, 1
                    )
                    want_packed = tf.reshape(
                        pack(codec.encode(want, None, None)[None], SignCodes()), [-1]
                    )
                    for how, (compensate, signs) in traced.items():
                        p, scale, m = compensate(
                            codec, vector, buffer, residual, lr_ratio, nesterov
                        )
                        case = f"{label} {how} lr_ratio={lr_ratio} nesterov={nesterov}"
                        _check(differ, f"{case}: p", p, want)
                        if want_m is not None:
                            _check(differ, f"{case}: momentum", m, want_m)
                        _check(differ, f"{label} {how}: scale", scale, want_scale)
                        packed, kept = signs(codec, p, scale)
                        _check(differ, f"{label} {how}: packed", packed, want_packed)
                        _check(differ, f"{label} {how}: residual", kept, want - want_sent)
                # The server of 3 workers' one-block messages, with a residual, and the
                # decoding of its message.
                rng = np.random.default_rng(numel)
                bits = tf.constant(rng.integers(0, 256, (3, -(-numel // 8))).astype(np.uint8))
                scales = tf.constant(rng.uniform(0.1, 2.0, 3).astype(np.float32))
                signs = tf.cast(unpack(bits, SignCodes(), numel), tf.float32)
                average = tf.reduce_sum(signs * scales[:, None], axis=0) / 3
                memories = []
                for _ in range(2):
                    memory = ErrorFeedback({"x": numel})
                    memory.residuals["x"].assign(residual)
                    memories.append(memory)
                codes, want_scale, want_sent = ServerStep(memories[0], "x", 0.3)(codec, average)
                # Messages as the sharded server receives them: a head of 2 block
                # scales (this server's elements in block 1), then the signs.
                heads = tf.stack([scales + 1, scales], axis=1)
                messages = tf.concat([tf.reshape(tf.bitcast(heads, tf.uint8), [3, 8]), bits], 1)
                packed, scale = fused.server_step(
                    ServerStep(memories[1], "x", 0.3), codec, messages, 8, 1, 3, numel
                )
                want_packed = tf.reshape(pack(codes[None], SignCodes()), [-1])
                _check(differ, f"{label}: server packed", packed, want_packed)
                _check(differ, f"{label}: server scale", scale, want_scale)
                _check(
                    differ,
                    f"{label}: server residual",
                    memories[1].proposed["x"],
                    memories[0].proposed["x"],
                )
                if scale.shape[0] == 1:
                    _check(
                        differ,
                        f"{label}: decoded server message",
                        fused.scaled_signs(packed[None], scale, numel)[0],
                        want_sent,
                    )
    return differ


def _check(differ, label, got, want):
    """Adds ``label`` to ``differ`` unless ``got`` is ``want`` (dtype, shape, bits; NaN
    equal to NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    same = got.dtype == want.dtype and got.shape == want.shape
    if not same or not np.array_equal(got, want, equal_nan=got.dtype.kind == "f"):
        differ.append(label)


def _kernel_cases(backend, quantizers, lengths):
    """Every comparison of the calls of ``backend`` (``fused`` or ``xla_fused``) and the
    ops; returns the labels of those that differ."""
    import importlib

    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf import fused, seeding
    from hvd_compress.tf.exchange import Meter, make_exchange
    from hvd_compress.tf.packing import pack, sum_rows, unpack

    differ = []

    def eager(call, *args):
        fused.ENABLED = False
        try:
            return call(*args)
        finally:
            fused.ENABLED = True

    def eager_payload(codec, exchange, codes):
        if exchange.name == "allreduce":
            return tf.cast(codec.values(codes), exchange.carrier)
        if exchange.name == "allgather":
            return tf.reshape(pack(codes[None], codec.code_space), [-1])
        padded = tf.pad(codes, [[0, exchange.world_size * exchange.length - exchange.numel]])
        return tf.reshape(
            pack(tf.reshape(padded, [exchange.world_size, -1]), codec.code_space), [-1]
        )

    calls = importlib.import_module(f"hvd_compress.tf.{backend}")
    encodes = [("eager", calls.encode)]
    if backend == "fused":  # a compiled call is a traced function already
        encodes.append(("traced", tf.function(calls.encode, autograph=False)))
    for reference in quantizers:
        codec = hvd_compress.resolve(reference, htf.CODECS)
        space = codec.code_space
        for numel in lengths:
            for bad in (None, float("nan")):
                label = f"{reference!r} numel={numel} bad={bad}"
                p = tf.constant(_vector(numel, numel, bad))
                scale = codec.local_scale(p)
                _check(differ, f"{label}: scale", scale, reference.local_scale(p.numpy()))
                key = seeding.stream_seed(numel, 3, 7, 11)
                codes = codec.encode(p, scale, seeding.uniforms(key, numel))
                sent = codec.decode(codec.values(codes), scale, 1)
                for name, world in (("allreduce", 4), ("allgather", 1), ("sharded", 3)):
                    exchange = make_exchange(name, codec, numel, world, Meter(), world)
                    want = eager_payload(codec, exchange, codes)
                    for how, encode in encodes:
                        payload, residual = encode(codec, exchange, p, scale, key, True)
                        # A NaN element's code is a cast of NaN, which TensorFlow and
                        # numba make differently; its step is skipped on every rank (the
                        # scale is +inf, the decoded values and residual NaN).
                        if bad is None:
                            _check(differ, f"{label} {name} {how}: payload", payload, want)
                        _check(differ, f"{label} {name} {how}: residual", residual, p - sent)
                # The receiving sides, on random codes of ``world`` workers.
                world = 4
                rows = pack(tf.constant(_codes(space, world, numel, numel)), space)
                values = codec.values(unpack(rows, space, numel))
                exchange = make_exchange("allreduce", codec, numel, world, Meter(), world)
                total = tf.cast(sum_rows(values), exchange.carrier)
                _check(
                    differ,
                    f"{label}: allreduce decode",
                    calls.decoded_totals(codec, total, scale, world),
                    eager(exchange.finish, (total, scale)),
                )
                _check(
                    differ,
                    f"{label}: allgather decode",
                    calls.decoded_sums(codec, rows, scale, world, numel),
                    codec.decode(sum_rows(values), scale, world),
                )
                own = tf.abs(tf.constant(_vector(world * scale.shape[0], numel + 1))) + 0.1
                own = tf.reshape(own, [world, -1])
                _check(
                    differ,
                    f"{label}: allgather own-scale decode",
                    calls.decoded_own_scales(
                        codec,
                        tf.concat([tf.reshape(tf.bitcast(own, tf.uint8), [world, -1]), rows], 1),
                        4 * own.shape[1],
                        world,
                        numel,
                    ),
                    tf.reduce_sum(codec.decode(values, own, world), axis=0),
                )
                sharded = make_exchange("sharded", codec, numel, world, Meter(), world)
                length, total_space = sharded.length, sharded.total_space
                received = pack(tf.constant(_codes(space, world, length, numel + 2)), space)
                summed = sum_rows(codec.values(unpack(received, space, length)))
                _check(
                    differ,
                    f"{label}: sharded sum",
                    calls.summed_codes(codec, received, length, total_space),
                    pack(summed, total_space),
                )
                gathered = pack(
                    tf.constant(_codes(total_space, world, length, numel + 3)), total_space
                )
                total = tf.reshape(unpack(gathered, total_space, length), [-1])[:numel]
                _check(
                    differ,
                    f"{label}: sharded decode",
                    calls.decoded_segments(
                        codec, gathered, total_space, length, scale, world, numel
                    ),
                    codec.decode(tf.cast(total, tf.int32), scale, world),
                )
    return differ


def _all_cases(backend, quantizers, blocks, lengths):
    return _kernel_cases(backend, quantizers, lengths) + _sign_cases(backend, blocks, lengths)


def test_kernels_are_the_tensorflow_ops():
    differ = run_parallel(_all_cases, 1, "fused", QUANTIZERS, BLOCKS, LENGTHS, timeout=600)[0]
    assert not differ, (len(differ), differ[:10])


def test_compiled_calls_are_the_tensorflow_ops():
    differ = run_parallel(_all_cases, 1, "xla_fused", *COMPILED_CASES, timeout=600)[0]
    assert not differ, (len(differ), differ[:10])


# Each exchange with the kernels, one with error feedback (the residuals they propose).
TAPE_CONFIGS = [
    (hvd_compress.TernGrad(min_size=1000, compress_classifier=False), "allreduce", {}),
    (hvd_compress.QSGDInf(bucket_size=512, min_size=1000), "allgather", {}),
    (hvd_compress.NUQSGD(bucket_size=2048, min_size=1000), "sharded", {}),
    (
        hvd_compress.QSGD(bits=3, bucket_size=700, min_size=1000),
        "sharded",
        {"error_feedback": True},
    ),
    (hvd_compress.BlockSign(min_size=0), "allgather", {}),
    (hvd_compress.BlockSign(min_size=0), "sharded", {}),
    (hvd_compress.BlockSign(max_block_size=300, min_size=0), "sharded", {}),
]


def _momentum_steps(nesterov, steps=3):
    """The weights and worker momentum after each of ``steps`` traced steps of ef-sign's
    ``DistributedOptimizer`` over an SGD with (``nesterov``) momentum 0.9."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(300), keras.layers.Dense(10)])
    optimizer = htf.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=MU, nesterov=nesterov),
        compression=hvd_compress.BlockSign(max_block_size=700, min_size=0),
    )

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    data = np.random.default_rng(100 + hvd.rank())
    states = []
    for _ in range(steps):
        step(data.standard_normal((8, 64)).astype(np.float32), data.integers(0, 10, 8))
        states.append([v.numpy() for v in model.trainable_variables])
        states.append([v.numpy() for v in optimizer.compression_variables])
    return states


def _applies_while_another_thread_traces():
    """What ``xla_fused.applies`` answers for TernGrad on a GPU tensor inside a compiled
    function as it traces, and in another thread meanwhile."""
    import threading

    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf import xla_fused

    codec = hvd_compress.resolve("terngrad", htf.CODECS)
    seen, inside, done = {}, threading.Event(), threading.Event()

    @xla_fused._compiled
    def traced(x):
        seen["tracing"] = xla_fused.applies(codec, on_cpu=False)
        inside.set()
        done.wait(60)
        return x

    tracer = threading.Thread(target=traced, args=(tf.ones([2]),))
    tracer.start()
    inside.wait(60)
    seen["other thread"] = xla_fused.applies(codec, on_cpu=False)
    done.set()
    tracer.join()
    seen["after"] = xla_fused.applies(codec, on_cpu=False)
    return seen


def test_only_the_tracing_thread_runs_the_ops_inside_a_compiled_function():
    [seen] = run_parallel(_applies_while_another_thread_traces, 1)
    assert seen == {"tracing": False, "other thread": True, "after": True}


# A tape loop's cases: each config's exchanged gradients, and ef-sign's optimizer with the
# worker momentum in heavy-ball (False) and Nesterov's (True) form.
TAPE_CASES = TAPE_CONFIGS + [False, True]
# How a tape loop runs the codecs, (the CPU kernels, the compiled calls on CPU tensors), and
# the cases it runs. Each compiled case compiles its functions for every tensor: an
# allreduce, the sharded exchange with error feedback, ef-sign's sharded server of several
# blocks, and its worker momentum, which the CPU kernels alone take into their pass.
PATHS = {
    "kernels": (True, False, tuple(range(len(TAPE_CASES)))),
    "xla": (False, True, (0, 3, 6, 8)),
    "ops": (False, False, tuple(range(len(TAPE_CASES)))),
}


def _tape_case(case):
    """The exchanged gradients of 3 traced steps of a tape config, or the states of
    ``_momentum_steps`` (``case``: whether in Nesterov's form)."""
    from .tf_perceptron import tape_steps

    if isinstance(case, bool):
        return _momentum_steps(case)
    codec, exchange, options = case
    return [
        [g.numpy() for g in exchanged]
        for _, exchanged, _, _ in tape_steps(
            3, True, compression=codec, exchange=exchange, **options
        )
    ]


def _tape_on_every_path():
    """Each of ``PATHS``' cases on that path, and how often the pipeline encoded through
    ``fused`` and called a compiled function on each."""
    import horovod.tensorflow as hvd

    from hvd_compress.tf import fused, xla_fused

    hvd.init()
    calls = {}
    encode = fused.encode

    def counted(*args, **kwargs):
        calls[path] = calls.get(path, 0) + 1
        return encode(*args, **kwargs)

    fused.encode = counted
    runs = {}
    for path, (fused.ENABLED, xla_fused.ON_CPU, cases) in PATHS.items():
        before = xla_fused.calls
        runs[path] = {case: _tape_case(TAPE_CASES[case]) for case in cases}
        calls[path, "compiled"] = xla_fused.calls - before
    return runs, calls


@pytest.mark.multiprocess
def test_tape_exchanges_the_same_gradients_on_every_path():
    for runs, calls in run_parallel(_tape_on_every_path, 2):
        # Traced once per config: an encode per compressed tensor, through the kernels or
        # the compiled functions; the uncompiled ops call neither.
        assert calls["kernels"] >= len(TAPE_CONFIGS) and calls["xla"] >= 3, calls
        assert "ops" not in calls and calls["ops", "compiled"] == 0, calls
        assert calls["kernels", "compiled"] == 0 and calls["xla", "compiled"] > 0, calls
        for path in ("kernels", "xla"):
            assert set(runs[path]) == set(PATHS[path][2])
            for case, got in runs[path].items():
                label = f"{path}: {TAPE_CASES[case]}"
                for step, (got_step, want_step) in enumerate(zip(got, runs["ops"][case])):
                    for g, w in zip(got_step, want_step):
                        np.testing.assert_array_equal(g, w, err_msg=f"{label} step {step}")
