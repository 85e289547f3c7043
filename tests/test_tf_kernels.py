"""The TensorFlow port's fused CPU kernels (``hvd_compress.tf.fused``) against the
TensorFlow ops they replace, bit for bit: TernGrad's and the QSGD family's scales (equal to
the float64 reference), every exchange's payload (packed codes of full and partial bytes
and buckets, the sharded padding, allreduce values), residuals, and every exchange's
receiving side; eagerly and inside ``tf.function``; and a tape loop on 2 ranks that
exchanges the same gradients with the kernels as without them.

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


def _kernel_cases(quantizers, lengths):
    """Every comparison of kernels and ops; returns the labels of those that differ."""
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf import fused, seeding
    from hvd_compress.tf.exchange import Meter, _sum_rows, make_exchange
    from hvd_compress.tf.packing import pack, unpack

    differ = []

    def check(label, got, want):
        got, want = np.asarray(got), np.asarray(want)
        if (
            got.dtype != want.dtype
            or got.shape != want.shape
            or not np.array_equal(got, want, equal_nan=got.dtype.kind == "f")
        ):
            differ.append(label)

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

    traced_encode = tf.function(fused.encode, autograph=False)
    for reference in quantizers:
        codec = hvd_compress.resolve(reference, htf.CODECS)
        space = codec.code_space
        for numel in lengths:
            for bad in (None, float("nan")):
                label = f"{reference!r} numel={numel} bad={bad}"
                p = tf.constant(_vector(numel, numel, bad))
                scale = codec.local_scale(p)
                check(f"{label}: scale", scale, reference.local_scale(p.numpy()))
                key = seeding.stream_seed(numel, 3, 7, 11)
                codes = codec.encode(p, scale, seeding.uniforms(key, numel))
                sent = codec.decode(codec.values(codes), scale, 1)
                for name, world in (("allreduce", 4), ("allgather", 1), ("sharded", 3)):
                    exchange = make_exchange(name, codec, numel, world, Meter(), world)
                    want = eager_payload(codec, exchange, codes)
                    for how, encode in (("eager", fused.encode), ("traced", traced_encode)):
                        payload, residual = encode(codec, exchange, p, scale, key, True)
                        # A NaN element's code is a cast of NaN, which TensorFlow and
                        # numba make differently; its step is skipped on every rank (the
                        # scale is +inf, the decoded values and residual NaN).
                        if bad is None:
                            check(f"{label} {name} {how}: payload", payload, want)
                        check(f"{label} {name} {how}: residual", residual, p - sent)
                # The receiving sides, on random codes of ``world`` workers.
                world = 4
                rows = pack(tf.constant(_codes(space, world, numel, numel)), space)
                values = codec.values(unpack(rows, space, numel))
                exchange = make_exchange("allreduce", codec, numel, world, Meter(), world)
                total = tf.cast(_sum_rows(values), exchange.carrier)
                check(
                    f"{label}: allreduce decode",
                    fused.decoded_totals(codec, total, scale, world),
                    eager(exchange.finish, (total, scale)),
                )
                check(
                    f"{label}: allgather decode",
                    fused.decoded_sums(codec, rows, scale, world, numel),
                    codec.decode(_sum_rows(values), scale, world),
                )
                own = tf.abs(tf.constant(_vector(world * scale.shape[0], numel + 1))) + 0.1
                own = tf.reshape(own, [world, -1])
                check(
                    f"{label}: allgather own-scale decode",
                    fused.decoded_own_scales(codec, rows, own, world, numel),
                    tf.reduce_sum(codec.decode(values, own, world), axis=0),
                )
                sharded = make_exchange("sharded", codec, numel, world, Meter(), world)
                length, total_space = sharded.length, sharded.total_space
                received = pack(tf.constant(_codes(space, world, length, numel + 2)), space)
                summed = _sum_rows(codec.values(unpack(received, space, length)))
                check(
                    f"{label}: sharded sum",
                    fused.summed_codes(codec, received, length, total_space),
                    pack(summed, total_space),
                )
                gathered = pack(
                    tf.constant(_codes(total_space, world, length, numel + 3)), total_space
                )
                total = tf.reshape(unpack(gathered, total_space, length), [-1])[:numel]
                check(
                    f"{label}: sharded decode",
                    fused.decoded_segments(
                        codec, gathered, total_space, length, scale, world, numel
                    ),
                    codec.decode(tf.cast(total, tf.int32), scale, world),
                )
    return differ


def test_kernels_are_the_tensorflow_ops():
    differ = run_parallel(_kernel_cases, 1, QUANTIZERS, LENGTHS, timeout=600)[0]
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
]


def _tape_with_and_without_kernels(configs):
    """The exchanged gradients of 3 traced steps per config, with the kernels and without,
    and how often the pipeline encoded through the kernels in either case."""
    import horovod.tensorflow as hvd

    from hvd_compress.tf import fused

    from .tf_perceptron import tape_steps

    hvd.init()
    calls = {True: 0, False: 0}
    encode = fused.encode

    def counted(*args, **kwargs):
        calls[fused.ENABLED] += 1
        return encode(*args, **kwargs)

    fused.encode = counted
    runs = []
    for enabled in (True, False):
        fused.ENABLED = enabled
        runs.append(
            [
                [
                    [g.numpy() for g in exchanged]
                    for _, exchanged, _, _ in tape_steps(
                        3, True, compression=codec, exchange=exchange, **options
                    )
                ]
                for codec, exchange, options in configs
            ]
        )
    return runs, calls


@pytest.mark.multiprocess
def test_tape_exchanges_the_same_gradients_with_the_kernels():
    for (kernels, ops), calls in run_parallel(_tape_with_and_without_kernels, 2, TAPE_CONFIGS):
        # Traced once per config: an encode per compressed tensor, only with the kernels.
        assert calls[True] >= len(TAPE_CONFIGS) and calls[False] == 0, calls
        for config, got, want in zip(TAPE_CONFIGS, kernels, ops):
            for step, (got_step, want_step) in enumerate(zip(got, want)):
                for g, w in zip(got_step, want_step):
                    np.testing.assert_array_equal(g, w, err_msg=f"{config} step {step}")
