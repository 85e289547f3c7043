"""Keras ``model.fit`` with ``hvd_compress.tf.DistributedOptimizer`` in real Horovod jobs of
2 processes (Keras 3, and Keras 2's ``tf_keras``): every rank holds the same weights after
every batch, for every codec.

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``).
"""

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel
from .horovod_keywords import NOT_DEFAULT
from .logs import record_messages

pytestmark = pytest.mark.multiprocess

SMALL = {"min_size": 1000}
# One codec of each way a message travels: uncompressed, cast, fixed-width codes, Elias
# codes of variable length, two-way error feedback, sparse indices and values. Every codec
# is checked against the reference through the tape (test_tf_distributed, test_tf_sparse):
# ``fit`` adds the Keras optimizer, its compiled step and the callbacks, the same for all.
CODECS = [
    hvd_compress.NoneCodec(),
    hvd_compress.FP16(),
    hvd_compress.TernGrad(min_size=1000, compress_classifier=False),
    hvd_compress.NUQSGD(bucket_size=1000, wire="elias", **SMALL),
    hvd_compress.BlockSign(min_size=0),
    hvd_compress.AdaComp(**SMALL),
]


def _perceptron(keras):
    """The 3-layer perceptron of the fits, in ``keras`` (Keras 3, or Keras 2's tf_keras)."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(160, activation="relu"),
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _recorder(keras):
    """A ``keras`` callback whose ``weights`` are the model's weights after every batch."""

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.weights = []

        def on_train_batch_end(self, batch, logs=None):
            self.weights.append(np.concatenate([w.ravel() for w in self.model.get_weights()]))

    return Recorder()


def _fit(codecs, batches=3, batch_size=8):
    """Fits a 3-layer perceptron on this rank's random data, from different initial weights
    on every rank; records the weights after every batch."""
    import os
    import tempfile

    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback

    hvd.init()

    runs = []
    for codec in codecs:
        keras.utils.set_random_seed(hvd.rank())
        model = _perceptron(keras)
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), compression=codec
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        data = np.random.default_rng(100 + hvd.rank())
        x = data.standard_normal((batches * batch_size, 64)).astype(np.float32)
        y = data.integers(0, 10, batches * batch_size)
        recorder = _recorder(keras)
        history = model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[BroadcastGlobalVariablesCallback(0), MetricAverageCallback(), recorder],
        )
        stats = optimizer.compression_stats()
        path = tf.train.Checkpoint(optimizer=optimizer).write(
            os.path.join(tempfile.mkdtemp(), "checkpoint")
        )
        runs.append(
            {
                "weights": recorder.weights,
                "loss": history.history["loss"],
                "bytes": stats["bytes_handed"],
                "step": stats["step"],
                "expected_bytes": optimizer._hvdc_pipeline.expected_bytes(),
                "tensors": stats["tensors"],
                "saved": [name for name, _ in tf.train.list_variables(path)],
            }
        )
    return runs


# Six models fitted and traced per rank, in one job of 2 ranks: every rank traces its own
# graphs, so 4 ranks on 2 cores take twice as long, and the exchanges at N = 4 are the
# tape's tests' (test_tf_distributed, test_tf_sparse); ``fit`` adds the same on every N.
@pytest.mark.timeout(1200)
def test_fit_keeps_ranks_identical_after_every_batch():
    per_rank = run_parallel(_fit, 2, CODECS, timeout=1100)
    for codec, results in zip(CODECS, zip(*per_rank)):
        first = results[0]
        assert len(first["weights"]) == 3 and first["step"] == 3
        for other in results[1:]:
            for batch, (got, want) in enumerate(zip(other["weights"], first["weights"])):
                np.testing.assert_array_equal(got, want, err_msg=f"{codec!r}, batch {batch}")
            assert other["loss"] == first["loss"]  # averaged by MetricAverageCallback
        assert not np.array_equal(first["weights"][0], first["weights"][-1])
        tensors = {name: reason for name, _, _, reason in first["tensors"]}
        compressed = [name for name, reason in tensors.items() if reason == "compressed"]
        if codec.code_space is not None:
            assert any(name.endswith("/kernel") for name in compressed), tensors
        if codec.wire == "fixed":
            assert all(r["bytes"] == r["expected_bytes"] for r in results)
        saved = " ".join(first["saved"])
        assert "optimizer/_hvdc_pipeline/state/step" in saved
        if codec.two_way:
            assert "_hvdc_pipeline/state/server/residuals" in saved
            assert "_hvdc_pipeline/state/worker/residuals" in saved


def _aggregate(configs, passes=2, batches=4):
    """Keras 3 ``DistributedOptimizer(backward_passes_per_step=passes)`` in a traced custom
    step, per (codec, average_aggregated_gradients) config: this rank's gradients and the
    weights after every batch, and the optimizer's iterations."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    runs = []
    for codec, average in configs:
        keras.utils.set_random_seed(0)  # the same initial weights on every rank
        model = _perceptron(keras)
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(0.1),
            compression=codec,
            backward_passes_per_step=passes,
            average_aggregated_gradients=average,
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return grads

        data = np.random.default_rng(100 + hvd.rank())
        grads, weights = [], [[w.copy() for w in model.get_weights()]]
        for _ in range(batches):
            x = data.standard_normal((8, 64)).astype(np.float32)
            y = data.integers(0, 10, 8)
            grads.append([g.numpy() for g in step(x, y)])
            weights.append([w.copy() for w in model.get_weights()])
        runs.append(
            {"grads": grads, "weights": weights, "iterations": int(optimizer.iterations.numpy())}
        )
    return runs


AGGREGATED = [
    (hvd_compress.NoneCodec(), False),
    (hvd_compress.NoneCodec(), True),
    (hvd_compress.TernGrad(min_size=1000, compress_classifier=False), False),
]


def test_backward_passes_are_summed_locally_and_exchanged_every_kth_batch():
    """With ``none``, the weights change only on every second batch, by the learning rate
    times the average over ranks of the two batches' summed (or averaged) gradients; with a
    codec the ranks agree."""
    passes, lr = 2, 0.1
    per_rank = run_parallel(_aggregate, 2, AGGREGATED, passes, timeout=600)
    for (codec, average), results in zip(AGGREGATED, zip(*per_rank)):
        first = results[0]
        assert first["iterations"] == len(first["grads"])  # every pass counts
        for other in results[1:]:
            for got, want in zip(other["weights"], first["weights"]):
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w, err_msg=repr(codec))
        for batch in range(len(first["grads"])):
            before, after = first["weights"][batch], first["weights"][batch + 1]
            if (batch + 1) % passes:
                for b, a in zip(before, after):
                    np.testing.assert_array_equal(a, b)
                continue
            if codec.name != "none":
                assert any(not np.array_equal(a, b) for a, b in zip(before, after))
                continue
            for index, (b, a) in enumerate(zip(before, after)):
                summed = [
                    sum(r["grads"][p][index] for p in range(batch + 1 - passes, batch + 1))
                    for r in results
                ]
                expected = np.mean(summed, axis=0) / (passes if average else 1)
                np.testing.assert_allclose(b - a, lr * expected, rtol=1e-4, atol=1e-7)


def _fit_keras2(codecs, batches=4, batch_size=8, passes=2):
    """``_fit`` with Keras 2 (``tf_keras``): Horovod's own Keras optimizer first (the
    uncompressed baseline), then this library's wrapper with each codec; then both again
    with ``backward_passes_per_step=passes``, the wrapper's with ``none``."""
    import os

    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tf_keras as keras

    import hvd_compress.tf as htf

    hvd.init()

    runs = []
    configs = [(None, 1)] + [(codec, 1) for codec in codecs]
    configs += [(None, passes), (hvd_compress.NoneCodec(), passes)]
    for codec, k in configs:
        keras.utils.set_random_seed(hvd.rank())
        model = _perceptron(keras)
        hvd.broadcast_variables(model.variables, root_rank=0)
        sgd = keras.optimizers.SGD(0.1, momentum=0.9)
        if codec is None:
            optimizer = hvd_keras.DistributedOptimizer(sgd, backward_passes_per_step=k)
        else:
            optimizer = htf.DistributedOptimizer(sgd, compression=codec, backward_passes_per_step=k)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        data = np.random.default_rng(100 + hvd.rank())
        x = data.standard_normal((batches * batch_size, 64)).astype(np.float32)
        y = data.integers(0, 10, batches * batch_size)
        recorder = _recorder(keras)
        model.fit(
            x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[recorder]
        )
        run = {"weights": recorder.weights, "iterations": int(optimizer.iterations.numpy())}
        if codec is not None:
            stats = optimizer.compression_stats()
            run.update(
                bytes=stats["bytes_handed"],
                step=stats["step"],
                expected=optimizer._hvdc_pipeline.expected_bytes(),
            )
        runs.append(run)
    return runs


@pytest.mark.timeout(900)
def test_keras2_fit_matches_horovods_optimizer_and_ranks_agree():
    """Keras 2 (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``): with ``none`` the wrapper trains
    bitwise as Horovod's own Keras optimizer, exchanging on every batch and, summing two
    batches locally, on every second (``backward_passes_per_step=2``); with a codec
    (ef-sign with its worker momentum on tf_keras's SGD) every rank holds the same weights
    after every batch."""
    codecs = [
        hvd_compress.NoneCodec(),
        hvd_compress.TernGrad(min_size=1000, compress_classifier=False),
        hvd_compress.BlockSign(min_size=0),
    ]
    per_rank = run_parallel(_fit_keras2, 2, codecs, timeout=800, new_interpreter=True)
    runs = per_rank[0]
    for horovods, ours in ((runs[0], runs[1]), (runs[-2], runs[-1])):
        for got, want in zip(ours["weights"], horovods["weights"]):
            np.testing.assert_array_equal(got, want)
        assert ours["iterations"] == horovods["iterations"] == 4
    aggregated = runs[-1]["weights"]
    # Steps after the 2nd and 4th batches; the 3rd only adds to the sums.
    np.testing.assert_array_equal(aggregated[1], aggregated[2])
    assert not np.array_equal(aggregated[0], aggregated[1])
    assert runs[-1]["step"] == 2
    for codec, (first, other) in zip(codecs, zip(*(runs[1:-2] for runs in per_rank))):
        assert len(first["weights"]) == 4 and first["step"] == 4
        for batch, (got, want) in enumerate(zip(other["weights"], first["weights"])):
            np.testing.assert_array_equal(got, want, err_msg=f"{codec!r}, batch {batch}")
        assert not np.array_equal(first["weights"][0], first["weights"][-1])
        assert first["bytes"] == first["expected"]


def _traced_wrappers():
    """What ``model.fit`` with ``jit_compile=True`` (Keras 3's default on a GPU) and a tape in
    an XLA-compiled ``tf.function`` raise; which of Horovod's keywords the TensorFlow
    wrappers refuse away from their defaults; and, for the tape's ``gradient`` and the
    optimizer's ``apply`` called in a ``tf.function`` traced with autograph, the file that
    called the pipeline's ``reduce``."""
    import inspect
    import os

    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf.pipeline import CompressionPipeline

    hvd.init()
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=htf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="terngrad"),
        loss="mse",
        jit_compile=True,
    )
    errors = []
    try:
        model.fit(x, y, verbose=0)
    except ValueError as error:
        errors.append(str(error))

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return htf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    try:
        step()
    except ValueError as error:
        errors.append(str(error))
    # Horovod's keywords taken at their defaults only (test_validation checks each one).
    refusals = {}
    for wrapper, keywords in (
        (
            lambda **k: htf.DistributedOptimizer(keras.optimizers.SGD(0.1), **k),
            (
                "name",
                "device_dense",
                "device_sparse",
                "num_groups",
                "groups",
            ),
        ),
        (
            lambda **k: htf.DistributedGradientTape(tf.GradientTape(), **k),
            ("device_dense", "device_sparse", "num_groups", "groups"),
        ),
    ):
        wrapper()  # every default accepted
        for keyword in keywords:
            try:
                wrapper(**{keyword: NOT_DEFAULT[keyword]})
            except ValueError as error:
                refusals[keyword] = str(error)

    callers = {}
    reduce = CompressionPipeline.reduce

    def recording_reduce(self, *args, **kwargs):
        # Converted, the wrapper's method calls from a file autograph generated.
        callers[caller] = os.path.basename(inspect.stack()[1].filename)
        return reduce(self, *args, **kwargs)

    CompressionPipeline.reduce = recording_reduce
    optimizer = htf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="terngrad")

    @tf.function
    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return htf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    @tf.function
    def optimizer_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    # recording_reduce reads `caller` while step() runs.
    for caller, step in (("tape", tape_step), ("optimizer", optimizer_step)):  # noqa: B007
        step()
    CompressionPipeline.reduce = reduce
    return errors, refusals, callers, _auto_jit_compile(keras, tf, htf, x, y)


def _auto_jit_compile(keras, tf, htf, x, y):
    """``model.compile``'s default ``jit_compile="auto"`` where Keras would turn XLA on (a GPU
    listed, as ``tf.config`` would on a GPU node) for a wrapped and a plain optimizer; whether
    the wrapped one's ``fit`` then trains; what the wrappers logged."""
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    listed = tf.config.list_physical_devices
    logged = record_messages()
    resolved = {}
    for name, optimizer in (
        ("wrapped", htf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="terngrad")),
        ("plain", keras.optimizers.SGD(0.1)),
    ):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        tf.config.list_physical_devices = lambda kind=None: (
            listed(kind) + ([gpu] if kind in (None, "GPU") else [])
        )
        try:
            model.compile(optimizer=optimizer, loss="mse")
        finally:
            tf.config.list_physical_devices = listed
        resolved[name] = model.jit_compile
        if name == "wrapped":
            before = model.get_weights()[0].copy()
            model.fit(x, y, verbose=0)
            resolved["trained"] = not np.array_equal(before, model.get_weights()[0])
    resolved["logged"] = [m for m in logged if "leaves XLA off" in m]
    return resolved


def test_xla_compiled_steps_are_refused_with_the_remedy(tf_wrappers):
    errors, _, _, _ = tf_wrappers
    assert len(errors) == 2
    for error in errors:
        assert "XLA cannot compile Horovod's collectives" in error
        assert "jit_compile=False" in error


def test_horovod_keywords_other_than_their_defaults_are_refused(tf_wrappers):
    _, refusals, _, _ = tf_wrappers
    assert set(refusals) == {
        "name",
        "device_dense",
        "device_sparse",
        "num_groups",
        "groups",
    }
    for keyword, error in refusals.items():
        assert f": {keyword}=" in error and "is not supported" in error


def test_autograph_leaves_the_library_unconverted(tf_wrappers):
    # Converting the pipeline's code costs most of the time of tracing a step, and it needs
    # no conversion: its tensor-dependent control flow is in explicit tf.cond calls.
    _, _, callers, _ = tf_wrappers
    assert callers == {"tape": "tape.py", "optimizer": "optimizer.py"}


def test_auto_jit_compile_resolves_to_no_xla_for_the_wrappers_only(tf_wrappers):
    # Keras 3 turns XLA on for "auto" wherever a GPU is listed; the wrapped model's step
    # would then be refused, the plain one's stays Keras's choice.
    *_, resolved = tf_wrappers
    logged = resolved.pop("logged")
    assert resolved == {"wrapped": False, "plain": True, "trained": True}
    assert len(logged) == 1 and "DistributedOptimizer leaves XLA off" in logged[0]


@pytest.fixture(scope="module")
def tf_wrappers():
    [result] = run_parallel(_traced_wrappers, 1, timeout=300)
    return result
