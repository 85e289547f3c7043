"""CELGC local SGD with per-worker gradient clipping for Keras (``hvd_compress.tf.LocalClipSGD``)
in real Horovod jobs; mirrors ``test_local_sgd``.

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

# With gamma / eta = 0.1 every step on these random batches is clipped (||g|| is 1.5 to 3.5) and
# moves the weights by exactly gamma.
LR, CLIP = 0.5, 0.05
STEPS = 13


def _model(keras, norm=False):
    """The perceptron of ``test_tf_momentum`` (10,240- and 1,920-element kernels); with
    ``norm``, a BatchNormalization layer for its moving statistics."""
    layers = [keras.Input((64,)), keras.layers.Dense(160, activation="relu", name="hidden")]
    if norm:
        layers.append(keras.layers.BatchNormalization(name="norm"))
    layers += [
        keras.layers.Dense(12, activation="relu", name="middle"),
        keras.layers.Dense(10, name="out"),
    ]
    return keras.Sequential(layers)


def _batch(rank, step):
    data = np.random.default_rng(1000 * step + rank)
    return (
        data.standard_normal((8, 64)).astype(np.float32),
        data.integers(0, 10, 8).astype(np.int32),
    )


def _flat(variables):
    return np.concatenate([np.asarray(v).ravel() for v in variables])


def _train(hvd, keras, tf, sync_every, clipping, compression, norm=False, **options):
    """Local clipped SGD on this rank's batches, eagerly; records the variables before each
    step, after its local update (what the round's allreduce receives, or the variables
    after a step without a round) and after the step, and the calls of Horovod's grouped
    allreduce by name."""
    import hvd_compress.tf as htf

    keras.utils.set_random_seed(hvd.rank())  # different on every rank until the broadcast
    model = _model(keras, norm)
    optimizer = htf.LocalClipSGD(
        keras.optimizers.SGD(LR),
        model,
        clip=CLIP,
        sync_every=sync_every,
        clipping=clipping,
        compression=compression,
        **options,
    )
    variables = model.trainable_variables
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    calls, handed = {}, {}
    real = hvd.grouped_allreduce

    def counted(tensors, **kwargs):
        calls[kwargs["name"]] = calls.get(kwargs["name"], 0) + 1
        handed[kwargs["name"]] = _flat(tensors)
        return real(tensors, **kwargs)

    hvd.grouped_allreduce = counted
    records = []
    try:
        for step in range(STEPS):
            before = _flat(variables)
            handed.clear()
            x, y = _batch(hvd.rank(), step)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(
                        y, model(x, training=True), from_logits=True
                    )
                )
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            after = _flat(variables)
            records.append(
                {
                    "before": before,
                    "after": after,
                    "local": handed.get("hvdc.local_sgd.parameters", after),
                    "bytes": optimizer.last_step_bytes,
                    "buffers": [np.asarray(b) for b in model.non_trainable_variables],
                }
            )
    finally:
        hvd.grouped_allreduce = real
    stats = optimizer.compression_stats()
    return {
        "records": records,
        "syncs": optimizer.syncs,
        "counts": calls,
        "local_steps": optimizer.local_steps,
        "tensors": stats["tensors"],
        "uncompressed": stats["bytes_uncompressed"],
    }


def _fit(hvd, keras, tf, sync_every=3, batches=7):
    """``model.fit`` (traced) with a round every ``sync_every`` batches; the weights after
    every batch, and the state's names in a checkpoint."""
    import os
    import tempfile

    import hvd_compress.tf as htf
    from hvd_compress.tf.callbacks import BroadcastGlobalVariablesCallback

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.weights = []

        def on_train_batch_end(self, batch, logs=None):
            self.weights.append(_flat(self.model.get_weights()))

    keras.utils.set_random_seed(hvd.rank())
    model = _model(keras)
    optimizer = htf.LocalClipSGD(
        keras.optimizers.SGD(LR, momentum=0.9),
        model,
        clip=CLIP,
        sync_every=sync_every,
        clipping="max",
        compression=hvd_compress.TernGrad(min_size=100),
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.concatenate([_batch(hvd.rank(), t)[0] for t in range(batches)])
    y = np.concatenate([_batch(hvd.rank(), t)[1] for t in range(batches)])
    recorder = Recorder()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[BroadcastGlobalVariablesCallback(0), recorder],
    )
    path = tf.train.Checkpoint(optimizer=optimizer).write(
        os.path.join(tempfile.mkdtemp(), "checkpoint")
    )
    return {
        "weights": recorder.weights,
        "syncs": optimizer.syncs,
        "saved": [name for name, _ in tf.train.list_variables(path)],
    }


UNCOMPRESSED = [
    (4, "local", "none"),
    (4, "max", "none"),
    (3, "global_average", "none"),
    (1, "local", "none"),
]
COMPRESSED = [(2, "local", hvd_compress.TernGrad(min_size=100))]


def _train_many(configs):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    results = [_train(hvd, keras, tf, *config) for config in configs]
    results.append(_train(hvd, keras, tf, 2, "local", "none", norm=True))
    results.append(_train(hvd, keras, tf, 2, "local", "none", norm=True, average_buffers=False))
    return results, _fit(hvd, keras, tf)


def _norm(x):
    return float(np.linalg.norm(x.astype(np.float64)))


def _check_rounds(results, sync_every):
    """Bitwise-equal variables on every rank after every round, different ones between."""
    for step in range(STEPS):
        after = [r["records"][step]["after"] for r in results]
        if (step + 1) % sync_every == 0:
            for other in after[1:]:
                np.testing.assert_array_equal(other, after[0], err_msg=f"step {step}")
        else:
            assert not np.array_equal(after[0], after[1]), f"step {step} was not local"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", [2, 4])
def test_rounds_agree_steps_are_clipped_and_collectives_counted(world):
    configs = UNCOMPRESSED + COMPRESSED
    per_rank = run_parallel(_train_many, world, configs, timeout=1100)
    runs = [list(results) for results in zip(*(r[0] for r in per_rank))]
    whole = runs[0][0]["uncompressed"]  # bytes of all parameters
    for (sync_every, clipping, compression), results in zip(configs, runs):
        _check_rounds(results, sync_every)
        for r in results:
            assert r["local_steps"] == STEPS
            assert r["syncs"] == STEPS // sync_every
            # "global_average" and "max" average the gradients at the first step after each
            # round (and at step 0), one more grouped allreduce of all parameters' size.
            gradient_rounds = 0 if clipping == "local" else -(-STEPS // sync_every)
            assert r["counts"].get("hvdc.local_sgd.gradients", 0) == gradient_rounds
            if compression == "none":
                assert r["counts"]["hvdc.local_sgd.parameters"] == STEPS // sync_every
            else:
                assert "hvdc.local_sgd.parameters" not in r["counts"]
            for step, record in enumerate(r["records"]):
                averages_gradients = clipping != "local" and step % sync_every == 0
                is_round = (step + 1) % sync_every == 0
                if compression == "none":
                    assert record["bytes"] == whole * (averages_gradients + is_round)
                elif is_round:  # compressed rounds hand fewer bytes than whole parameters
                    assert 0 < record["bytes"] < whole / 3
                else:
                    assert record["bytes"] == 0
            if clipping == "global_average":
                continue  # its step is gamma / ||g_bar|| times ||g_i||, which may exceed gamma
            last_round = r["records"][0]["before"]
            for step, record in enumerate(r["records"]):
                is_round = (step + 1) % sync_every == 0
                if is_round and compression != "none":
                    last_round = record["after"]
                    continue  # the local update of a compressed round is not observed
                # A local step moves the weights by at most gamma; with "local" clipping and
                # every gradient above gamma / eta, by exactly gamma.
                move = _norm(record["local"] - record["before"])
                assert move <= CLIP * (1 + 1e-5)
                if clipping == "local":
                    assert move == pytest.approx(CLIP, rel=1e-5)
                # Drift from the last round: at most gamma per local step since (Lemma 1).
                since = step % sync_every + 1
                assert _norm(record["local"] - last_round) <= CLIP * since * (1 + 1e-5)
                if is_round:
                    last_round = record["after"]
    tensors = runs[len(UNCOMPRESSED)][0]["tensors"]
    assert {name.split("/", 1)[1] for name, _, _, reason in tensors if reason == "compressed"} >= {
        "hidden/kernel",
        "middle/kernel",
    }, tensors

    # BatchNormalization's moving statistics are averaged at rounds unless
    # average_buffers=False.
    for results, averaged in ((runs[-2], True), (runs[-1], False)):
        buffers = [_flat(r["records"][1]["buffers"]) for r in results]
        assert np.array_equal(buffers[0], buffers[1]) == averaged

    # model.fit: rounds after batches 3 and 6 (compressed, "max" clipping, momentum).
    fits = [r[1] for r in per_rank]
    for batch in range(7):
        same = all(np.array_equal(f["weights"][batch], fits[0]["weights"][batch]) for f in fits[1:])
        assert same == ((batch + 1) % 3 == 0), batch
    assert all(f["syncs"] == 2 for f in fits)
    saved = " ".join(fits[0]["saved"])
    for state in (
        "_hvdc_steps",
        "_hvdc_syncs",
        "_hvdc_anchors",
        "_hvdc_pipeline/state/worker/residuals",
    ):
        assert f"optimizer/{state}" in saved, (state, saved)


def _against_clipped_sgd(steps=12, lr=0.1, clip=0.21):
    """One worker, a round after every step: LocalClipSGD against Keras SGD with the step
    size min(eta_t, gamma_t / ||g||), gamma_t = gamma eta_t / eta_0, written out, under
    momentum, weight decay and a learning-rate decay. Also returns the messages of bad
    options."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    settings = dict(momentum=0.9, weight_decay=1e-3)
    results = {}
    for clipping in ("local", "global_average", "max"):
        keras.utils.set_random_seed(0)
        ours, theirs = _model(keras), _model(keras)
        theirs.set_weights(ours.get_weights())
        schedule = keras.optimizers.schedules.ExponentialDecay(lr, 4, 0.5, staircase=True)
        opt_ours = htf.LocalClipSGD(
            keras.optimizers.SGD(schedule, **settings),
            ours,
            clip=clip,
            sync_every=1,
            clipping=clipping,
        )
        opt_theirs = keras.optimizers.SGD(lr, **settings)
        clipped = []
        for step in range(steps):
            x, y = _batch(0, step)
            grads = {}
            for model in (ours, theirs):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(
                        keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
                    )
                grads[id(model)] = tape.gradient(loss, model.trainable_variables)
            eta = float(schedule(step))
            norm = float(tf.linalg.global_norm(grads[id(theirs)]))
            rate = min(eta, clip * eta / lr / norm)
            clipped.append(rate < eta)
            opt_theirs.learning_rate = rate
            for model, optimizer in ((ours, opt_ours), (theirs, opt_theirs)):
                optimizer.apply_gradients(zip(grads[id(model)], model.trainable_variables))
        results[clipping] = (_flat(ours.get_weights()), _flat(theirs.get_weights()), clipped)

    model = _model(keras)
    errors = []
    for optimizer, options in [
        (None, {"clip": 0.0}),
        (None, {"clip": float("inf")}),
        (None, {"sync_every": 0}),
        (None, {"clipping": "global"}),
        (None, {"compression": "zip"}),
        (keras.optimizers.Adam(), {}),
        (keras.optimizers.SGD(0.0), {}),
    ]:
        try:
            htf.LocalClipSGD(
                optimizer or keras.optimizers.SGD(0.1), model, **{"clip": 1.0, **options}
            )
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return results, errors


@pytest.mark.timeout(600)
def test_one_worker_with_a_round_every_step_is_clipped_sgd():
    ((results, errors),) = run_parallel(_against_clipped_sgd, 1, timeout=500)
    for clipping, (ours, theirs, clipped) in results.items():
        assert any(clipped) and not all(clipped)  # both branches of the min were taken
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6, err_msg=clipping)
    assert len(errors) == 7
    for error, match in zip(
        errors,
        [
            "clip (gamma) must be > 0",
            "clip must be finite",
            "sync_every must be >= 1, got 0",
            "clipping must be one of 'local', 'global_average', 'max'; got 'global'",
            "compression must be one of",
            "optimizer must be a keras.optimizers.SGD",
            "the learning rate must be > 0",
        ],
    ):
        assert match in error, (match, error)
