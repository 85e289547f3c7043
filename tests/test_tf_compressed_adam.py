"""Compressed Adam in the Keras ``DistributedOptimizer`` (``hvd_compress.tf.compressed_adam``),
in real Horovod jobs: Keras's AdamW itself during the warm-up, the frozen-variance step after
it, nothing lost by the momentum's error feedback, bitwise-equal ranks and a bitwise resume;
the same float64 reference as the PyTorch port's (``tests/compressed_adam_reference.py``).

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

from hvd_compress import remedies

from . import compressed_adam_reference as reference
from . import keras_perceptron
from .compressed_adam_reference import WARMUP
from .harness import run_parallel
from .logs import record_messages

pytestmark = pytest.mark.multiprocess

STEPS = 12


def _build(codec, exchange):
    """The tests' model (the same initial weights on every rank) and Keras AdamW in the
    compressed-Adam mode."""
    import keras

    import hvd_compress.tf as htf

    keras.utils.set_random_seed(0)
    model = keras_perceptron.model(keras)
    optimizer = htf.DistributedOptimizer(
        _adamw(keras), compression=codec, exchange=exchange, compressed_adam=WARMUP
    )
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _adamw(keras):
    return keras.optimizers.AdamW(
        reference.LR,
        beta_1=reference.BETA1,
        beta_2=reference.BETA2,
        epsilon=reference.EPS,
        weight_decay=reference.DECAY,
    )


def _train(model, optimizer, steps):
    """Trains on this rank's batches of ``steps``; records what the reference needs."""
    import horovod.tensorflow as hvd

    from hvd_compress.tf.pipeline import variable_name

    step = keras_perceptron.trainer(model, optimizer)
    variables = model.trainable_variables
    names = [variable_name(v) for v in variables]
    record = {"grads": [], "params": [], "m": [], "v": [], "handed": []}
    for t in steps:
        grads = step(*keras_perceptron.batch(hvd.rank(), t))
        record["grads"].append({n: g.numpy() for n, g in zip(names, grads)})
        record["params"].append(np.concatenate([v.numpy().ravel() for v in variables]))
        for key, moments in (("m", optimizer._momentums), ("v", optimizer._velocities)):
            record[key].append(
                {
                    n: moments[optimizer._get_variable_index(v)].numpy()
                    for n, v in zip(names, variables)
                }
            )
        record["handed"].append(optimizer.compression_stats()["bytes_handed"])
    return dict(record, names=names)


def _adamw_replay(records):
    """Keras's AdamW, traced as the wrapped one is, on the ranks' averaged gradients from
    the same start: the parameters after each step."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model, optimizer = keras_perceptron.model(keras), _adamw(keras)
    variables = model.trainable_variables

    @tf.function
    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))

    params = []
    for step in range(len(records[0]["grads"])):
        average = [
            sum(r["grads"][step][n] for r in records) * np.float32(1 / len(records))
            for n in records[0]["names"]
        ]
        apply(average)
        params.append(np.concatenate([v.numpy().ravel() for v in variables]))
    return params


def _compressed_adam_job(codec, directory=None, resume_at=None, replay=False):
    """Trains in the compressed-Adam mode for ``STEPS``; with ``resume_at``, also a second
    model and optimizer restored from the first's checkpoint at that step (written under
    ``directory``) and trained on the same remaining batches; with ``replay``, Keras's
    AdamW on the ranks' averaged gradients too."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    model, optimizer = _build(codec, "auto")
    record = _train(model, optimizer, range(resume_at or STEPS))
    if resume_at is not None:
        checkpoint = f"{directory}/rank{hvd.rank()}"
        tf.train.Checkpoint(model=model, optimizer=optimizer).write(checkpoint)
        after = _train(model, optimizer, range(resume_at, STEPS))
        for key in ("grads", "params", "m", "v", "handed"):
            record[key] += after[key]
        resumed, resumed_optimizer = _build(codec, "auto")
        tf.train.Checkpoint(model=resumed, optimizer=resumed_optimizer).read(
            checkpoint
        ).assert_consumed()
        record["resumed"] = _train(resumed, resumed_optimizer, range(resume_at, STEPS))["params"]
    pipeline = optimizer._hvdc_pipeline
    memories = {"worker": pipeline.state.worker, "server": pipeline.state.server}
    for role, memory in memories.items():
        residuals = {} if memory is None else memory.residuals
        record[role] = {name: r.numpy() for name, r in residuals.items()}
    record["uncompressed"] = optimizer.compression_stats()["bytes_uncompressed"]
    if replay:
        record["adamw"] = _adamw_replay(hvd.allgather_object(record))
    return record


@pytest.mark.timeout(600)
def test_identity_codec_is_keras_adamw_until_the_freeze_then_frozen_variance_adam():
    results = run_parallel(_compressed_adam_job, 2, "none", replay=True)
    first = results[0]
    for r in results[1:]:
        np.testing.assert_array_equal(np.stack(r["params"]), np.stack(first["params"]))
    for step in range(WARMUP):
        np.testing.assert_array_equal(first["params"][step], first["adamw"][step])
    assert not np.allclose(first["params"][-1], first["adamw"][-1], rtol=1e-4)
    # float32 against float64 arithmetic over the steps after the freeze.
    for got, want in zip(first["params"][WARMUP:], reference.frozen_variance_replay(results)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, codec", [(2, "ef-sign"), (4, "ef-sign"), (2, "dgc")])
def test_momentum_ranks_agree_and_nothing_is_lost(world, codec, tmp_path):
    # Resumed at N = 2 only: with more ranks a sum's order in Horovod's ring allreduce
    # depends on where each tensor lands in its fusion buffer, which varies between runs.
    resume_at = STEPS - 3 if world == 2 else None
    results = run_parallel(_compressed_adam_job, world, codec, str(tmp_path), resume_at)
    first = results[0]
    for r in results[1:]:
        np.testing.assert_array_equal(np.stack(r["params"]), np.stack(first["params"]))
    for r in results:
        if resume_at is not None:
            np.testing.assert_array_equal(np.stack(r["resumed"]), np.stack(r["params"][resume_at:]))
        # Uncompressed during the warm-up, the codec's messages after it.
        assert r["handed"][:WARMUP] == [r["uncompressed"]] * WARMUP
        assert max(r["handed"][WARMUP:]) < r["uncompressed"] / 8
    for v in first["v"][WARMUP:]:  # frozen at the warm-up's
        for name in first["names"]:
            np.testing.assert_array_equal(v[name], first["v"][WARMUP - 1][name])
    assert reference.momentum_error_feedback_gap(results) < 1e-5


def _refusals():
    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tf as htf

    hvd.init()
    refused = []
    for optimizer, value, adaptive in (
        (keras.optimizers.AdamW(), -1, False),
        (keras.optimizers.AdamW(), True, False),
        (keras.optimizers.SGD(0.1), 5, False),
        (keras.optimizers.Adam(amsgrad=True), 5, False),
        (keras.optimizers.AdamW(), 5, True),
    ):
        try:
            htf.DistributedOptimizer(
                optimizer, compression="ef-sign", compressed_adam=value, adaptive=adaptive
            )
        except (TypeError, ValueError) as error:
            refused.append(f"{type(error).__name__}: {error}")
    return refused


def test_bad_compressed_adam_is_refused():
    (refused,) = run_parallel(_refusals, 1)
    assert len(refused) == 5
    assert refused[0].startswith("ValueError") and "compressed_adam" in refused[0]
    assert refused[1].startswith("TypeError") and "compressed_adam" in refused[1]
    assert "compressed_adam needs a keras.optimizers.Adam" in refused[2]
    assert "compressed_adam does not support amsgrad" in refused[3]
    assert "does not combine with adaptive" in refused[4]


def _remedies():
    """The T_w and the worker momentum's form each Keras optimizer's wrapper chose for
    ef-sign and TernGrad, and what the wrappers logged."""

    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tf as htf

    hvd.init()
    logged = record_messages()
    chosen = {}
    for name, make in (
        ("AdamW", keras.optimizers.AdamW),
        ("Adam", keras.optimizers.Adam),
        ("SGD", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
        ("RMSprop", keras.optimizers.RMSprop),
    ):
        for codec in ("ef-sign", "terngrad"):
            wrapped = htf.DistributedOptimizer(make(), compression=codec)
            chosen[name, codec] = wrapped._hvdc_compressed_adam, wrapped._hvdc_worker_momentum
    explicit = htf.DistributedOptimizer(
        keras.optimizers.AdamW(), compression="adacomp", compressed_adam=0
    )
    chosen["AdamW", "adacomp:0"] = explicit._hvdc_compressed_adam, None
    heavy_ball = htf.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), compression="ef-sign", worker_momentum=True
    )
    chosen["SGD", "ef-sign:True"] = None, heavy_ball._hvdc_worker_momentum
    nesterov = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
    chosen["SGD(nesterov)", "ef-sign"] = (
        None,
        htf.DistributedOptimizer(nesterov, compression="ef-sign")._hvdc_worker_momentum,
    )
    # TernGrad's gap under Nesterov SGD (``remedies.NESTEROV_GAPS``): warned by its name,
    # not with other hyperparameters.
    for codec in ("terngrad", "terngrad:clip=2.0"):
        nesterov = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
        htf.DistributedOptimizer(nesterov, compression=codec)
    return chosen, logged


def test_keras_adam_gets_compressed_adam_for_error_feedback_codecs():
    """``hvd_compress.remedies`` in the Keras wrapper, as ``tests/test_remedies.py`` checks
    it in PyTorch's."""
    ((chosen, logged),) = run_parallel(_remedies, 1)
    assert chosen == {
        ("AdamW", "ef-sign"): (200, None),
        ("AdamW", "terngrad"): (None, None),
        ("Adam", "ef-sign"): (200, None),
        ("Adam", "terngrad"): (None, None),
        ("SGD", "ef-sign"): (None, "nesterov"),
        ("SGD", "terngrad"): (None, None),
        ("RMSprop", "ef-sign"): (None, None),
        ("RMSprop", "terngrad"): (None, None),
        ("AdamW", "adacomp:0"): (None, None),
        ("SGD", "ef-sign:True"): (None, "optimizer"),
        ("SGD(nesterov)", "ef-sign"): (None, "optimizer"),
    }
    assert any("turned compressed Adam on for ef-sign with AdamW" in m for m in logged), logged
    assert any("RMSprop is not one the wrappers know" in m for m in logged), logged
    assert any("ef-sign's worker momentum in Nesterov's form" in m for m in logged), logged
    # TernGrad's gap under Adam and AdamW (``remedies.ADAM_GAPS``), measured on the Keras LM.
    for optimizer in ("Adam", "AdamW"):
        assert any(f"terngrad with its defaults under {optimizer} ended" in m for m in logged)
    [nesterov] = [m for m in logged if "under SGD with Nesterov momentum" in m]
    gap, closer = remedies.NESTEROV_GAPS["terngrad"]
    assert f"terngrad with its defaults under SGD with Nesterov momentum {gap}" in nesterov
    assert closer in nesterov
    # Adam's, AdamW's, SGD's and RMSprop's with ef-sign, TernGrad's two under Adam and one
    # under Nesterov SGD.
    assert len(logged) == 7, logged
