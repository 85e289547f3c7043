"""TensorFlow jobs and checks that several multi-process test modules share: the tape
loops each rank runs inside a Horovod job (``harness.run_parallel``) and the checks of their
results against the numpy reference. They import TensorFlow when called, in the child
processes only (see ``test_tf_codecs``)."""

import numpy as np
import pytest

import hvd_compress
from hvd_compress import simulate

from . import process_sets
from .tf_perceptron import tape_steps


def tape_loop(configs, steps=3, layout=None):
    """Trains the perceptron once per config, averaged in this rank's process set of
    ``layout`` (``tests.process_sets``); records per step the local gradients, the
    exchanged ones, the weights and the uniforms drawn."""
    import horovod.tensorflow as hvd

    from hvd_compress.tf.pipeline import UNCOMPRESSED, uniforms

    process_set = process_sets.join(hvd, layout)
    runs = []
    for codec, exchange, traced in configs:
        records = []
        for t, (local, exchanged, variables, pipeline) in enumerate(
            tape_steps(steps, traced, compression=codec, exchange=exchange, process_set=process_set)
        ):
            draws = {
                plan.name: uniforms(0, pipeline.rank, t, plan.index, [plan.numel]).numpy()
                for plan in pipeline.plans
                if plan.exchange != UNCOMPRESSED
            }
            records.append(
                {
                    "local": [g.numpy() for g in local],
                    "exchanged": [g.numpy() for g in exchanged],
                    "params": np.concatenate([v.numpy().ravel() for v in variables]),
                    "uniforms": draws,
                    "bytes": int(pipeline.last_step_bytes.numpy()),
                }
            )
        runs.append(
            {
                "records": records,
                "expected_bytes": pipeline.expected_bytes(),
                "tensors": pipeline.compression_stats()["tensors"],
            }
        )
    return runs


def _reference_step(codec, results, step, memory):
    """The exchanged gradients every rank should hold, from all ranks' local gradients.
    ``memory`` carries the error-feedback residuals of a two-way codec between steps."""
    world = len(results)
    expected = []
    for index, (name, _numel, exchange, reason) in enumerate(results[0]["tensors"]):
        grads = [r["records"][step]["local"][index] for r in results]
        if reason != "compressed":
            expected.append(np.sum(np.stack(grads), axis=0) / world)
        elif codec.two_way:
            expected.append(_two_way_replicated(codec, grads, memory, name))
        else:
            draws = [r["records"][step]["uniforms"][name] for r in results]
            expected.append(simulate.exchange_step(codec, grads, draws, exchange))
    return expected


def _two_way_replicated(codec, grads, memory, name):
    """dist-EF-blockSGD with a replicated server: worker residuals e_i, server residual e~."""
    world = len(grads)
    average = np.zeros(grads[0].size, np.float32)
    for rank, g in enumerate(grads):
        p = g.ravel() + memory.get((rank, name), 0)
        scale = codec.local_scale(p)
        sent = codec.decode(codec.encode(p, scale, None), scale, 1)
        memory[rank, name] = p - sent
        average = average + codec.decode(codec.encode(p, scale, None), scale, world)
    q = average + memory.get(("server", name), 0)
    scale = codec.local_scale(q)
    sent = codec.decode(codec.encode(q, scale, None), scale, 1)
    memory["server", name] = q - sent
    return sent.reshape(grads[0].shape)


def check_tape_loop(codec, exchange, results):
    memory = {}
    for step in range(len(results[0]["records"])):
        first = results[0]["records"][step]
        for other in results[1:]:
            record = other["records"][step]
            np.testing.assert_array_equal(
                record["params"], first["params"], err_msg=f"ranks differ at step {step}"
            )
            for got, want in zip(record["exchanged"], first["exchanged"]):
                np.testing.assert_array_equal(got, want)
        if codec.two_way and exchange == "sharded":
            continue  # server blocks are cut at shard edges; ranks agreeing is the check
        for index, want in enumerate(_reference_step(codec, results, step, memory)):
            name, _, travel, _ = results[0]["tensors"][index]
            tolerance = 1e-3 if codec.name == "fp16" or travel.startswith("allreduce (") else 1e-5
            np.testing.assert_allclose(
                first["exchanged"][index],
                want,
                rtol=tolerance,
                atol=1e-6,
                err_msg=f"{name} at step {step}",
            )
        if codec.wire == "fixed":  # variable-length payloads have no formula
            for r in results:
                assert r["records"][step]["bytes"] == r["expected_bytes"]


def tape_sources(layout=None):
    """A tape's sources beyond variables, in this rank's process set of ``layout``: a
    watched tensor, a variable and a variable registered with ``register_local_source``,
    eagerly and traced, with local gradients scaled and not (codec ``none``); two eager steps
    of TernGrad on the watched tensor; and a Keras ``DistributedOptimizer`` with one kernel
    registered by ``register_local_var``. Records local and returned gradients."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    process_set = process_sets.join(hvd, layout)
    data = np.random.default_rng(200 + hvd.rank())
    x = tf.constant(data.standard_normal(3000).astype(np.float32))
    shared = tf.Variable(np.linspace(-1, 1, 3000, dtype=np.float32), name="shared")
    own = tf.Variable(np.linspace(2, 1, 3000, dtype=np.float32), name="own")

    def step(x, compression="none", scale=True):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            loss = tf.reduce_sum(x * shared * own) + tf.reduce_sum(x * x * shared)
        sources = [x, shared, own]
        local = tape.gradient(loss, sources)
        distributed = htf.DistributedGradientTape(
            tape, compression=compression, process_set=process_set, scale_local_gradients=scale
        )
        distributed.register_local_source(own)
        returned = distributed.gradient(loss, sources)
        pipelines.append(distributed.pipeline)
        return local, returned

    pipelines = []
    traced = tf.function(step, input_signature=[tf.TensorSpec([3000], tf.float32)])
    runs = {}
    for name, run in (
        ("eager", lambda: step(x)),
        ("unscaled", lambda: step(x, scale=False)),
        ("traced", lambda: traced(x)),
    ):
        local, returned = run()
        runs[name] = ([g.numpy() for g in local], [g.numpy() for g in returned])
    terngrad = htf.TernGrad(min_size=1000)
    for _ in range(2):
        local, returned = step(x, terngrad)
    runs["terngrad"] = ([g.numpy() for g in local], [g.numpy() for g in returned])
    terngrad = {
        "steps": int(pipelines[-1].state.step.numpy()),
        "plans": [p.name for p in pipelines[-1].plans],
    }

    inputs = data.standard_normal((16, 8)).astype(np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    model.set_weights(
        [np.full(w.shape, 0.1 * (i + 1), np.float32) for i, w in enumerate(model.get_weights())]
    )
    optimizer = htf.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=process_set)
    optimizer.register_local_var(model.layers[0].kernel)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(inputs) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    optimizer.apply(grads, model.trainable_variables)
    keras_run = {
        "local": [g.numpy() for g in grads],
        "steps": [b - v.numpy() for b, v in zip(before, model.trainable_variables)],
    }
    refusals = []
    try:
        optimizer.register_local_var(model.layers[1].kernel)
    except ValueError as error:
        refusals.append(str(error))
    momentum = htf.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), compression="ef-sign", process_set=process_set
    )
    try:
        momentum.register_local_var(model.layers[0].kernel)
    except ValueError as error:
        refusals.append(str(error))
    return {
        "runs": runs,
        "terngrad": terngrad,
        "keras": keras_run,
        "refusals": refusals,
        "size": process_set.size(),
        "included": bool(process_set.included()),
    }


def check_tape_sources(results):
    """The records of ``tape_sources`` of the ranks of one set (in set order): the watched
    tensor and the variable averaged over the set, the local source this rank's own gradient
    (divided by the set's size unless unscaled); the Keras kernel registered local stepped on
    its rank's own gradient."""
    size = results[0]["size"]
    assert size == len(results)
    for name in ("eager", "unscaled", "traced", "terngrad"):
        for index in (0, 1):  # the watched tensor and the shared variable
            mean = np.mean([r["runs"][name][0][index] for r in results], axis=0)
            for r in results:
                returned = r["runs"][name][1][index]
                np.testing.assert_array_equal(returned, results[0]["runs"][name][1][index])
                if name != "terngrad":
                    np.testing.assert_allclose(returned, mean, rtol=1e-5, atol=1e-6)
        for r in results:
            local, returned = r["runs"][name][0][2], r["runs"][name][1][2]
            expected = local if name == "unscaled" else local / size
            np.testing.assert_allclose(returned, expected, rtol=1e-6)
    for r in results:
        # One pipeline over both steps: the watched tensor is known by its place.
        assert r["terngrad"] == {"steps": 2, "plans": ["source_0", "shared:0"]}
        lr = 0.1
        local_kernel = lr * r["keras"]["local"][0] / size
        np.testing.assert_allclose(r["keras"]["steps"][0], local_kernel, rtol=1e-5, atol=1e-7)
        for index in (1, 2, 3):
            mean = np.mean([s["keras"]["local"][index] for s in results], axis=0)
            np.testing.assert_allclose(r["keras"]["steps"][index], lr * mean, rtol=1e-5, atol=1e-7)
        after_step, with_momentum = r["refusals"]
        assert "register_local_var after the first step" in after_step
        assert (
            "worker_momentum='nesterov'" in with_momentum
            and "worker_momentum=False" in with_momentum
        )


def check_tape_sources_outside(result):
    """The records of ``tape_sources`` of a rank outside its set: every gradient its own,
    the local source's divided by the set's size unless unscaled."""
    assert not result["included"]
    for name, (local, returned) in result["runs"].items():
        np.testing.assert_array_equal(returned[0], local[0])
        np.testing.assert_array_equal(returned[1], local[1])
        scale = 1 if name == "unscaled" else result["size"]
        np.testing.assert_allclose(returned[2], local[2] / scale, rtol=1e-6)


CLT_K = hvd_compress.CyclicLocalTopK(ratio=10, beta=0.5, min_size=0)


def sparse_tape_loop(codec, steps, traced, layout=None):
    """Trains the perceptron with ``codec`` (its output layer sent whole when ``traced``),
    averaged in this rank's process set of ``layout`` (``tests.process_sets``); records per
    step the local gradients, the exchanged ones, the weights and the byte accounting, and
    at the end the worker memory."""
    import horovod.tensorflow as hvd

    from hvd_compress.tf.pipeline import variable_name

    process_set = process_sets.join(hvd, layout)
    records = []
    for local, exchanged, variables, pipeline in tape_steps(
        steps,
        traced,
        compression=codec,
        uncompressed=("out/kernel", "out/bias") if traced else (),
        process_set=process_set,
    ):
        names = [variable_name(v) for v in variables]  # TensorFlow's: "hidden/kernel:0"
        stats = pipeline.compression_stats()
        records.append(
            {
                "local": {n: g.numpy() for n, g in zip(names, local)},
                "exchanged": {n: g.numpy() for n, g in zip(names, exchanged)},
                "params": np.concatenate([v.numpy().ravel() for v in variables]),
                "bytes": stats["bytes_handed"],
                "layers": stats["layers"],
                "expected": pipeline.expected_bytes(),
            }
        )
    return {
        "records": records,
        "tensors": stats["tensors"],
        "kinds": {plan.name: plan.layer for plan in pipeline.plans},
        "memory": {name: r.numpy() for name, r in pipeline.state.worker.residuals.items()},
    }


def assert_sparse_ranks_agree(results):
    for step, first in enumerate(results[0]["records"]):
        for other in results[1:]:
            record = other["records"][step]
            np.testing.assert_array_equal(
                record["params"], first["params"], err_msg=f"ranks differ at step {step}"
            )
            for name, grad in record["exchanged"].items():
                np.testing.assert_array_equal(
                    grad, first["exchanged"][name], err_msg=f"{name} at step {step}"
                )


def compressed_names(results):
    return [name for name, _, _, reason in results[0]["tensors"] if reason == "compressed"]


def check_clt_k(results):
    """Replays CLT-k in numpy (``pt_jobs.replay_clt_k``) from every rank's local
    gradients; the leader's indices must have been used."""
    import torch

    from .pt_jobs import replay_clt_k

    names = compressed_names(results)
    as_torch = [
        {
            "records": [
                {
                    "local": {n: torch.from_numpy(record["local"][n]) for n in names},
                    "exchanged": {n: torch.from_numpy(g) for n, g in record["exchanged"].items()},
                    "params": torch.from_numpy(record["params"]),
                    "bytes": record["bytes"],
                    "expected": record["expected"],
                }
                for record in r["records"]
            ],
            "memory": {n: torch.from_numpy(r["memory"][n]) for n in names},
        }
        for r in results
    ]
    world = len(results)
    chosen = replay_clt_k(as_torch, CLT_K)
    for step, indices in enumerate(chosen):
        assert any(
            not np.array_equal(own[step % world], own[(step + 1) % world])
            for own in indices.values()
        )
    for r in results:
        for record in r["records"]:
            assert record["layers"]["linear"]["density"] == pytest.approx(0.1, abs=0.01)
