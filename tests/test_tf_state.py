"""TensorFlow state that survives: a Keras job checkpointed with ``tf.train.Checkpoint`` at
step k and restored in new processes continues bitwise-identically to the uninterrupted job,
for every codec of the TensorFlow port (step counters, random streams and residuals included).

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

SMALL = {"min_size": 100}
# (label, codec, error_feedback): every codec, and error feedback on a one-way codec.
CASES = [
    ("none", hvd_compress.NoneCodec(), None),
    ("fp16", hvd_compress.FP16(), None),
    ("terngrad", hvd_compress.TernGrad(**SMALL), None),
    ("terngrad+ef", hvd_compress.TernGrad(**SMALL), True),
    ("qsgd", hvd_compress.QSGD(**SMALL), None),
    ("qsgd-inf", hvd_compress.QSGDInf(**SMALL), None),
    ("nuqsgd-elias", hvd_compress.NUQSGD(wire="elias", **SMALL), None),
    ("ef-sign", hvd_compress.BlockSign(min_size=0), None),
    ("adacomp", hvd_compress.AdaComp(**SMALL), None),
    ("clt-k", hvd_compress.CyclicLocalTopK(ratio=10, beta=0.5, **SMALL), None),
]
STEPS, SAVE_AT = 8, 4


def _train(directory, start):
    """Trains every case from ``start`` (0: from scratch, saving at ``SAVE_AT``; otherwise
    restoring the checkpoint of ``start``) to ``STEPS``; the weights after every step."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    trajectories = {}
    for label, codec, error_feedback in CASES:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([3, 6], [0.05, 0.025, 0.01])
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(schedule, momentum=0.9),
            compression=codec,
            seed=3,
            error_feedback=error_feedback,
        )
        optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        path = f"{directory}/{label}-rank{hvd.rank()}"
        if start:
            checkpoint.read(path).assert_consumed()
        trajectory = []
        for step in range(start, STEPS):
            if step == SAVE_AT and not start:
                checkpoint.write(path)
            data = np.random.default_rng(1000 * step + hvd.rank())
            x = data.standard_normal((8, 64)).astype(np.float32)
            y = data.integers(0, 10, 8)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            trajectory.append(np.concatenate([w.ravel() for w in model.get_weights()]))
        trajectories[label] = trajectory
    return trajectories


@pytest.mark.timeout(900)
def test_checkpoint_and_resume_continue_bitwise(tmp_path):
    uninterrupted = run_parallel(_train, 2, str(tmp_path), 0, timeout=800)
    resumed = run_parallel(_train, 2, str(tmp_path), SAVE_AT, timeout=800)
    for rank in range(2):
        for label, _, _ in CASES:
            straight, again = uninterrupted[rank][label], resumed[rank][label]
            assert len(again) == STEPS - SAVE_AT
            for step, (a, b) in enumerate(zip(straight[SAVE_AT:], again), SAVE_AT):
                np.testing.assert_array_equal(a, b, err_msg=f"{label}, rank {rank}, step {step}")
    # The cases really compress and train: ranks agree, and the weights moved.
    for label, _, _ in CASES:
        np.testing.assert_array_equal(uninterrupted[0][label][-1], uninterrupted[1][label][-1])
        assert not np.array_equal(uninterrupted[0][label][0], uninterrupted[0][label][-1])


def _mismatched(kind):
    """Each wrapper built with a different codec or model on rank 1: the message each rank
    raises, per wrapper (None if it built)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    odd = hvd.rank() == 1
    inputs = 32 if kind == "parameters" and odd else 64
    codec = "qsgd-inf" if kind == "codec" and odd else "terngrad"
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(10)])
    messages = {}
    try:
        htf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=codec).build(
            model.trainable_variables
        )
        messages["optimizer"] = None
    except ValueError as error:
        messages["optimizer"] = str(error)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones((2, inputs))))
    try:
        htf.DistributedGradientTape(tape, compression=codec).gradient(
            loss, model.trainable_variables
        )
        messages["tape"] = None
    except ValueError as error:
        messages["tape"] = str(error)
    return messages


@pytest.mark.parametrize("kind", ["codec", "parameters"])
def test_ranks_with_different_configurations_fail_fast_on_every_rank(kind):
    """The PyTorch port's check (``tests/test_state.py``), with the same message."""
    results = run_parallel(_mismatched, 2, kind)
    for messages in results:
        for message in messages.values():
            assert message is not None and "different compression configurations" in message
            assert f"{kind}: rank 0: " in message and "rank 1: " in message
    if kind == "codec":
        assert "TernGrad(" in results[0]["tape"] and "QSGDInf(" in results[0]["tape"]
