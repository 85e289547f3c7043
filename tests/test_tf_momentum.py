"""dist-EF-blockSGDM's worker momentum in the Keras ``DistributedOptimizer``
(``hvd_compress.tf.momentum``), in real Horovod jobs: the virtual-iterate invariant across a
learning-rate drop, bitwise-equal ranks, and Keras SGD recovered with the identity codec.

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

from . import keras_perceptron
from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

MU = 0.9


def _train_ef(exchange, steps=40, drop_at=20):
    """dist-EF-blockSGDM (every tensor compressed, Nesterov worker momentum) on random data,
    with the learning rate divided by 10 after ``drop_at`` steps; records what the invariant
    needs."""
    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tf as htf

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different on every rank until the broadcast
    model = keras_perceptron.model(keras)
    variables = model.trainable_variables
    hvd.broadcast_variables([v.value for v in variables], root_rank=0)
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([drop_at - 1], [0.05, 0.005])
    optimizer = htf.DistributedOptimizer(
        keras.optimizers.SGD(schedule, momentum=MU, nesterov=True),
        compression=htf.BlockSign(min_size=0),
        exchange=exchange,
    )
    assert optimizer._hvdc_worker_momentum  # on by default for ef-sign with momentum

    step = keras_perceptron.trainer(model, optimizer)

    def flat():
        return np.concatenate([v.numpy().ravel() for v in variables])

    x0, params, grads, rates = flat(), [], [], []
    for t in range(steps):
        rates.append(float(optimizer.learning_rate))
        grads.append([g.numpy().ravel() for g in step(*keras_perceptron.batch(hvd.rank(), t))])
        params.append(flat())
    pipeline = optimizer._hvdc_pipeline
    return {
        "x0": x0,
        "params": params,
        "grads": grads,
        "rates": rates,
        "worker": {k: v.numpy() for k, v in pipeline.state.worker.residuals.items()},
        "server": {k: v.numpy() for k, v in pipeline.state.server.residuals.items()},
        "names": [plan.name for plan in pipeline.plans],
        "reasons": [plan.reason for plan in pipeline.plans],
    }


def _virtual_iterate_gap(results, exchange):
    """max relative | x_T - eta_T (e~_T + mean_i e_T,i) - (x_0 - sum_t eta_t mean_i u_t,i) |,
    with u = g + mu m, m = mu m + g (residuals are kept in gradient units)."""
    world = len(results)
    first = results[0]
    rates, last = first["rates"], first["rates"][-1]
    gaps, offset = [], 0
    for index, name in enumerate(first["names"]):
        size = first["grads"][0][index].size
        drift = np.zeros(size)
        for r in results:
            m = np.zeros(size)
            for step, grads in enumerate(r["grads"]):
                g = grads[index].astype(np.float64)
                m = MU * m + g
                drift += rates[step] * (g + MU * m) / world
        worker = sum(r["worker"][name].astype(np.float64) for r in results) / world
        if exchange == "sharded":
            server = np.concatenate([r["server"][name] for r in results]).astype(np.float64)
        else:
            server = first["server"][name].astype(np.float64)
        x0 = first["x0"][offset : offset + size].astype(np.float64)
        xT = first["params"][-1][offset : offset + size].astype(np.float64)
        want = x0 - drift
        got = xT - last * (server + worker)
        gaps.append(float(np.abs(got - want).max() / np.abs(want).max()))
        offset += size
    return max(gaps)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
def test_worker_momentum_invariant_across_lr_drop_and_rank_consistency(world):
    for exchange in ("allgather", "sharded"):
        results = run_parallel(_train_ef, world, exchange, timeout=800)
        assert set(results[0]["reasons"]) == {"compressed"}
        for step in range(len(results[0]["params"])):
            for r in results[1:]:
                np.testing.assert_array_equal(
                    r["params"][step],
                    results[0]["params"][step],
                    err_msg=f"{exchange}: ranks differ at {step}",
                )
        rates = results[0]["rates"]
        assert rates[0] == pytest.approx(10 * rates[-1])  # the drop happened
        assert _virtual_iterate_gap(results, exchange) < 1e-5, exchange


def _identity_against_sgd(steps=10):
    """The identity codec with worker momentum against Keras SGD(momentum, nesterov=True,
    weight_decay) in ``model.fit``, on the same data from the same weights; and with worker
    momentum in Nesterov's form over a heavy-ball SGD (ef-sign's default there)."""
    import os
    import tempfile

    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    settings = dict(learning_rate=0.05, momentum=MU, nesterov=True, weight_decay=1e-2)
    x = np.concatenate([keras_perceptron.batch(0, t)[0] for t in range(steps)])
    y = np.concatenate([keras_perceptron.batch(0, t)[1] for t in range(steps)])
    weights = []
    for mode in (True, "nesterov", None):
        keras.utils.set_random_seed(0)
        model = keras_perceptron.model(keras)
        optimizer = keras.optimizers.SGD(**{**settings, "nesterov": mode != "nesterov"})
        if mode is not None:
            optimizer = htf.DistributedOptimizer(
                optimizer, compression="none", worker_momentum=mode
            )
            ours = optimizer
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights.append(np.concatenate([w.ravel() for w in model.get_weights()]))
    path = tf.train.Checkpoint(optimizer=ours).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    saved = [name for name, _ in tf.train.list_variables(path)]
    try:
        htf.DistributedOptimizer(
            keras.optimizers.Adam(), compression="ef-sign", worker_momentum=True
        )
        error = None
    except TypeError as e:
        error = str(e)
    return {
        "ours": weights[0],
        "forced": weights[1],
        "theirs": weights[2],
        "saved": saved,
        "error": error,
        "default": htf.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=MU), compression="ef-sign"
        )._hvdc_worker_momentum,
        "plain": htf.DistributedOptimizer(
            keras.optimizers.SGD(0.1), compression="ef-sign"
        )._hvdc_worker_momentum,
    }


@pytest.mark.timeout(600)
def test_identity_codec_at_one_worker_is_keras_nesterov_sgd_with_weight_decay():
    (r,) = run_parallel(_identity_against_sgd, 1, timeout=500)
    np.testing.assert_allclose(r["ours"], r["theirs"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["forced"], r["theirs"], rtol=1e-5, atol=1e-6)
    assert any(
        name.startswith("optimizer/_hvdc_momentum/momentum/") and "hidden.Skernel" in name
        for name in r["saved"]
    ), r["saved"]
    assert any(name.startswith("optimizer/_hvdc_momentum/learning_rate") for name in r["saved"])
    assert r["error"] == "worker_momentum needs a keras.optimizers.SGD, got Adam"
    assert r["default"] == "nesterov" and r["plain"] is None
