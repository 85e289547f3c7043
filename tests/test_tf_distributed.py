"""The TensorFlow port in real Horovod jobs of 2 and 4 processes over Gloo: a custom
``DistributedGradientTape`` loop keeps every rank's weights identical after every step, and
the exchanged gradients equal the numpy reference (``hvd_compress.simulate``) computed from
every rank's local gradients and replayed random draws.

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress
from hvd_compress import simulate

from . import process_sets
from .harness import run_parallel
from .tf_perceptron import tape_steps

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


def _tape_loop(configs, steps=3, layout=None):
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


def _check(codec, exchange, results):
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


# Each configuration is traced once per rank (TensorFlow tracing is slow on 2 cores), so each
# runs in one world: the sharded exchanges at N = 4, where shards differ in length, the
# others at N = 2. The PyTorch port runs every exchange at both.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", [2, 4])
def test_tape_loop_ranks_agree_and_match_reference(world):
    configs = [config for config in CONFIGS if (config[1] == "sharded") == (world == 4)]
    per_rank = run_parallel(_tape_loop, world, configs, timeout=1100)
    for (codec, exchange, _), results in zip(configs, zip(*per_rank)):
        reasons = [reason for _, _, _, reason in results[0]["tensors"]]
        if codec.code_space is not None:
            assert reasons[0] == "compressed", (codec, results[0]["tensors"])  # hidden/kernel
        _check(codec, exchange, list(results))


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
