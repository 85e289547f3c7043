"""TensorFlow state that survives: a Keras job checkpointed with ``tf.train.Checkpoint`` at
step k and restored in new processes continues bitwise-identically to the uninterrupted job,
for every codec of the TensorFlow port (step counters, random streams and residuals included).

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress

from . import process_sets
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


def _train(directory, start, cases=CASES, exchange="auto", layout=None):
    """Trains every case from ``start`` (0: from scratch, saving at ``SAVE_AT``; otherwise
    restoring the checkpoint of ``start``) to ``STEPS`` by ``exchange``, Horovod started
    for ``layout`` (``tests.process_sets``); the weights after every step."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    process_sets.join(hvd, layout)
    trajectories = {}
    for label, codec, error_feedback in cases:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([3, 6], [0.05, 0.025, 0.01])
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(schedule, momentum=0.9),
            compression=codec,
            exchange=exchange,
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
    resumed = run_parallel(_train, 2, str(tmp_path), SAVE_AT, timeout=800, own_job=True)
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


@pytest.mark.timeout(600)
def test_two_level_exchange_resumes_bitwise(tmp_path, monkeypatch):
    """On 2 nodes of 2 ranks each rank's checkpoint holds the residuals of its shard (and
    ef-sign's server's): resumed on the same nodes, training continues bitwise."""
    # Horovod's fused allreduce of the uncompressed tensors sums 4 ranks' elements in an
    # order that depends on which tensors share its buffer; without fusion every run sums
    # alike.
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    cases = [case for case in CASES if case[0] in ("terngrad+ef", "ef-sign")]
    options = {"cases": cases, "exchange": "two-level", "layout": process_sets.DYNAMIC}
    args = (_train, 4, str(tmp_path))
    uninterrupted = run_parallel(*args, 0, launcher="2x2", timeout=500, **options)
    resumed = run_parallel(*args, SAVE_AT, launcher="2x2", timeout=500, own_job=True, **options)
    for rank in range(4):
        for label, _, _ in cases:
            assert len(resumed[rank][label]) == STEPS - SAVE_AT
            for step, (a, b) in enumerate(
                zip(uninterrupted[rank][label][SAVE_AT:], resumed[rank][label]), SAVE_AT
            ):
                np.testing.assert_array_equal(a, b, err_msg=f"{label}, rank {rank}, step {step}")
            np.testing.assert_array_equal(
                uninterrupted[rank][label][-1], uninterrupted[0][label][-1]
            )


# What differs on rank 1, and the key of the description that names it.
MISMATCHES = {
    "codec": "codec",
    "hyperparameters": "codec",
    "exchange": "exchange",
    "parameters": "parameters",
    "adaptive": "adaptive",
    "optimizer": "optimizer",
}


def _mismatched(kind):
    """Each wrapper built with a different codec, codec parameter, exchange, model, adaptive
    mode or ``sparse_as_dense`` on rank 1: the message each rank raises at its first step, per
    wrapper (None if it stepped)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    odd = hvd.rank() == 1
    inputs = 32 if kind == "parameters" and odd else 64
    codec = {"codec": "qsgd-inf", "hyperparameters": "terngrad:clip=2.0"}.get(kind, "terngrad")
    codec = codec if odd else "terngrad"
    options = {
        "exchange": {"exchange": "allgather"},
        "adaptive": {"adaptive": True},
        "optimizer": {"sparse_as_dense": True},
    }
    options = options.get(kind, {}) if odd else {}
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(10)])
    messages = {}
    try:
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(0.1), compression=codec, **options
        )
        optimizer.build(model.trainable_variables)
        optimizer.apply([tf.zeros_like(v) for v in model.trainable_variables])
        messages["optimizer"] = None
    except ValueError as error:
        messages["optimizer"] = str(error)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones((2, inputs))))
    try:
        htf.DistributedGradientTape(tape, compression=codec, **options).gradient(
            loss, model.trainable_variables
        )
        messages["tape"] = None
    except ValueError as error:
        messages["tape"] = str(error)
    return messages


def _mismatched_everywhere():
    import horovod.tensorflow as hvd

    hvd.init()
    return {kind: _mismatched(kind) for kind in MISMATCHES}


@pytest.fixture(scope="module")
def mismatched():
    return run_parallel(_mismatched_everywhere, 2)


@pytest.mark.parametrize("kind", MISMATCHES)
def test_ranks_with_different_configurations_fail_fast_on_every_rank(mismatched, kind):
    """The PyTorch port's check (``tests/test_state.py``), with the same message."""
    results = [rank[kind] for rank in mismatched]
    for messages in results:
        for message in messages.values():
            assert message is not None and "different compression configurations" in message
            assert f"{MISMATCHES[kind]}: rank 0: " in message and "rank 1: " in message
    if kind == "codec":
        assert "TernGrad(" in results[0]["tape"] and "QSGDInf(" in results[0]["tape"]
    if kind == "hyperparameters":
        assert "clip=2.0" in results[0]["tape"]


# (label, codec, error_feedback, exchange): ef-sign's servers know their result's finiteness
# from the server scales (``_Exchange.finite``): the replicated one at N = 2 ("auto"), the
# sharded one; error feedback on a one-way codec is checked over every gradient.
POISONED = [
    ("terngrad+ef", hvd_compress.TernGrad(**SMALL), True, "auto"),
    ("ef-sign", hvd_compress.BlockSign(min_size=0), None, "auto"),
    ("ef-sign sharded", hvd_compress.BlockSign(min_size=0), None, "sharded"),
]
POISON_AT = 2


def _poisoned(steps):
    """Rank 1's loss is NaN at ``POISON_AT``. Each case of ``POISONED`` trains through
    ``DistributedGradientTape`` in a ``tf.function``, skipping the base step when the
    exchanged gradients are not finite; the worker-momentum mode of ``DistributedOptimizer``
    (ef-sign over an SGD with momentum) runs up to the poisoned step. Per case and step:
    the weights, the compression state and whether the exchanged gradients were finite
    (for the optimizer, which applies them: whether the weights are)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()

    def batch(step):
        data = np.random.default_rng(1000 * step + hvd.rank())
        x = data.standard_normal((8, 64)).astype(np.float32)
        poison = np.float32("nan" if step == POISON_AT and hvd.rank() == 1 else 1.0)
        return x, data.integers(0, 10, 8), poison

    def model_and_loss():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )

        def loss(x, y, poison):
            logits = model(x)
            return poison * tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )

        return model, loss

    def record(model, variables, finite):
        return {
            "weights": np.concatenate([w.ravel() for w in model.get_weights()]),
            "state": [v.numpy().copy() for v in variables],
            "finite": finite,
        }

    records = {}
    for label, codec, error_feedback, exchange in POISONED:
        model, loss = model_and_loss()
        sgd = keras.optimizers.SGD(0.05)
        tapes = []

        @tf.function
        def exchanged(x, y, poison):
            with tf.GradientTape() as tape:
                value = loss(x, y, poison)
            tape = htf.DistributedGradientTape(
                tape, compression=codec, exchange=exchange, error_feedback=error_feedback, seed=3
            )
            tapes.append(tape)
            return tape.gradient(value, model.trainable_variables)

        records[label] = []
        for step in range(steps):
            grads = exchanged(*batch(step))
            finite = all(np.isfinite(g.numpy()).all() for g in grads)
            if finite:
                sgd.apply_gradients(zip(grads, model.trainable_variables))
            records[label].append(record(model, tapes[0].pipeline.variables, finite))

    model, loss = model_and_loss()
    optimizer = htf.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compression=hvd_compress.BlockSign(min_size=0)
    )
    optimizer.build(model.trainable_variables)

    @tf.function
    def train(x, y, poison):
        with tf.GradientTape() as tape:
            value = loss(x, y, poison)
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    records["ef-sign, worker momentum"] = []
    for step in range(POISON_AT + 1):
        train(*batch(step))
        # The optimizer applies the exchanged gradients: NaN weights on every rank.
        finite = all(np.isfinite(w).all() for w in model.get_weights())
        records["ef-sign, worker momentum"].append(
            record(model, optimizer.compression_variables, finite)
        )
    return records


def test_nan_on_one_rank_skips_the_step_everywhere_and_leaves_no_trace():
    """The PyTorch port's check (``tests/test_state.py``): residuals (worker and server),
    the step counter aside, and worker momentum are untouched by the poisoned step on every
    rank, and training goes on, finite and identical on every rank."""
    results = run_parallel(_poisoned, 2, POISON_AT + 3, timeout=400)
    for records in results:
        for label, steps in records.items():
            before, skipped = steps[POISON_AT - 1], steps[POISON_AT]
            assert before["finite"] and not skipped["finite"], label
            # The step counter (a scalar) moves on; every other state variable stays.
            kept = [(a, b) for a, b in zip(before["state"], skipped["state"]) if a.ndim]
            assert len(kept) >= 2, label
            for a, b in kept:
                np.testing.assert_array_equal(a, b, err_msg=label)
            if label in {case[0] for case in POISONED}:
                np.testing.assert_array_equal(before["weights"], skipped["weights"])
                for later in steps[POISON_AT + 1 :]:
                    assert later["finite"], label
                    assert not np.array_equal(later["weights"], skipped["weights"]), label
    for label in results[0]:
        for a, b in zip(results[0][label], results[1][label]):
            np.testing.assert_array_equal(a["weights"], b["weights"], err_msg=label)
