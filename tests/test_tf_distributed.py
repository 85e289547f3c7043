"""The TensorFlow port in real Horovod jobs of 2 and 4 processes over Gloo: a custom
``DistributedGradientTape`` loop keeps every rank's weights identical after every step, and
the exchanged gradients equal the numpy reference (``hvd_compress.simulate``) computed from
every rank's local gradients and replayed random draws.

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel
from .tf_jobs import (
    check_tape_loop,
    check_tape_sources,
    tape_loop,
    tape_sources,
)

pytestmark = pytest.mark.multiprocess

SMALL = {"min_size": 1000}
# (codec, exchange, traced): every codec, every exchange of some codec, one eager run.
CONFIGS = [
    (hvd_compress.NoneCodec(), "auto", True),
    (hvd_compress.FP16(), "sharded", True),
    (hvd_compress.TernGrad(min_size=1000, compress_classifier=False), "allreduce", True),
    (hvd_compress.TernGrad(min_size=1000, compress_classifier=False), "allgather", True),
    (hvd_compress.TernGrad(min_size=1000, compress_classifier=False), "sharded", True),
    (hvd_compress.QSGD(bits=3, bucket_size=700, **SMALL), "allgather", True),
    (hvd_compress.QSGDInf(bucket_size=512, **SMALL), "allreduce", True),
    (hvd_compress.QSGDInf(bucket_size=512, **SMALL), "sharded", False),
    (hvd_compress.NUQSGD(bucket_size=2048, **SMALL), "sharded", True),
    (hvd_compress.NUQSGD(bucket_size=1000, wire="elias", **SMALL), "allgather", True),
    (hvd_compress.BlockSign(min_size=0), "allgather", True),
    (hvd_compress.BlockSign(max_block_size=300, min_size=0), "sharded", True),
]


# Each configuration is traced once per rank (TensorFlow tracing is slow on 2 cores), so each
# runs in one world: the sharded exchanges at N = 4, where shards differ in length, the
# others at N = 2. The PyTorch port runs every exchange at both.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", [2, 4])
def test_tape_loop_ranks_agree_and_match_reference(world):
    configs = [config for config in CONFIGS if (config[1] == "sharded") == (world == 4)]
    per_rank = run_parallel(tape_loop, world, configs, timeout=1100)
    for (codec, exchange, _), results in zip(configs, zip(*per_rank)):
        reasons = [reason for _, _, _, reason in results[0]["tensors"]]
        if codec.code_space is not None:
            assert reasons[0] == "compressed", (codec, results[0]["tensors"])  # hidden/kernel
        check_tape_loop(codec, exchange, list(results))


def _both_horovod_modules():
    """The TensorFlow tape's exchange in a process that imported horovod.torch after
    horovod.tensorflow: the refusal's message, or None."""
    import horovod.tensorflow as hvd
    import horovod.torch  # noqa: F401  (taking over the process sets)
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    v = tf.Variable(tf.ones(20_000))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    try:
        htf.DistributedGradientTape(tape, compression="terngrad").gradient(loss, [v])
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.multiprocess
def test_both_horovod_modules_in_one_process_are_refused():
    """The exchange would be skipped (the global process set answers that this rank is
    not in it); it refuses instead, saying why."""
    for message in run_parallel(_both_horovod_modules, 2, own_job=True):
        assert message is not None and "horovod.torch and horovod.tensorflow" in message


@pytest.mark.timeout(600)
def test_tape_takes_watched_tensors_and_local_sources_and_keras_local_variables():
    check_tape_sources(run_parallel(tape_sources, 2, timeout=500))


def embedding_gradients():
    """An Embedding's ``tf.IndexedSlices`` gradient through the tape and the Keras optimizer
    (an SGD with lr 1, whose step is the gradient it was given): left sparse (Horovod's
    sparse allreduce, codec none) and densified by ``sparse_as_dense`` (TernGrad). Records
    the local and the returned gradients, densified, with their types."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    ids = tf.constant(np.random.default_rng(300 + hvd.rank()).integers(0, 50, (8, 5)))

    def model_and_loss():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 40),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        return model, lambda: tf.reduce_sum(model(ids) ** 2)

    records = {}
    for sparse_as_dense in (False, True):
        codec = htf.TernGrad(min_size=1000) if sparse_as_dense else "none"
        model, loss = model_and_loss()
        with tf.GradientTape(persistent=True) as tape:
            value = loss()
        local = tape.gradient(value, model.trainable_variables)
        distributed = htf.DistributedGradientTape(
            tape, compression=codec, sparse_as_dense=sparse_as_dense
        )
        returned = distributed.gradient(value, model.trainable_variables)
        records["tape", sparse_as_dense] = {
            "types": (type(local[0]).__name__, type(returned[0]).__name__),
            "local": [tf.convert_to_tensor(g).numpy() for g in local],
            "returned": [tf.convert_to_tensor(g).numpy() for g in returned],
            "reasons": [t[3] for t in distributed.pipeline.compression_stats()["tensors"]],
        }
        model, loss = model_and_loss()
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(1.0), compression=codec, sparse_as_dense=sparse_as_dense
        )
        with tf.GradientTape() as tape:
            value = loss()
        local = tape.gradient(value, model.trainable_variables)
        before = [v.numpy() for v in model.trainable_variables]
        optimizer.apply(local, model.trainable_variables)
        records["keras", sparse_as_dense] = {
            "types": (type(local[0]).__name__, None),
            "local": [tf.convert_to_tensor(g).numpy() for g in local],
            "returned": [b - v.numpy() for b, v in zip(before, model.trainable_variables)],
            "reasons": [t[3] for t in optimizer.compression_stats()["tensors"]],
        }
    return records


@pytest.mark.timeout(600)
def test_embedding_gradients_go_sparse_or_dense_through_both_wrappers():
    per_rank = run_parallel(embedding_gradients, 2, timeout=500)
    for key, first in per_rank[0].items():
        wrapper, sparse_as_dense = key
        assert first["types"][0] == "IndexedSlices", key
        if wrapper == "tape":
            assert first["types"][1] == ("EagerTensor" if sparse_as_dense else "IndexedSlices"), key
        others = [r[key] for r in per_rank]
        for index, returned in enumerate(first["returned"]):
            for other in others[1:]:
                np.testing.assert_array_equal(other["returned"][index], returned, err_msg=key)
        if sparse_as_dense:  # the embedding through TernGrad, the classifier whole
            assert first["reasons"][0] == "compressed", key
        else:
            mean = np.mean([o["local"][0] for o in others], axis=0)
            np.testing.assert_allclose(first["returned"][0], mean, rtol=1e-5, atol=1e-6)
        for index in range(1, len(first["returned"])):  # the Dense layer: averaged whole
            mean = np.mean([o["local"][index] for o in others], axis=0)
            np.testing.assert_allclose(first["returned"][index], mean, rtol=1e-5, atol=1e-6)
