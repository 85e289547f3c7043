"""The TensorFlow port's program on every rank of a benchmark job:
``python -m benchmarks.tf_worker SPEC``, the twin of ``benchmarks.worker`` for the spec's
``tf_methods``.

=================  =========================================================================
``tf-hvd-none``    ``horovod.tensorflow.DistributedGradientTape``, uncompressed fp32 allreduce
``tf-hvd-fp16``    the same with ``hvd.Compression.fp16``
``tf-terngrad``    ``hvd_compress.tf.DistributedGradientTape``, TernGrad (paper defaults)
``tf-qsgd-inf``    the same, QSGD with max-norm scaling, 4 bits, buckets of 512
``tf-ef-sign``     the same, dist-EF-blockSGD's scaled sign with worker and server error
                   feedback (the tape has no worker momentum: Keras's SGD applies it)
``tf-<codec>-auto`` the same codec with ``adaptive=True``
=================  =========================================================================

Each step is one ``tf.function``: the forward and backward pass of the model, the tape's
exchange, and Keras's SGD with momentum. The models have the tensors of the PyTorch
worker's, in Keras's layouts: the MNIST-1D CNN of ``examples/mnist1d_keras.py`` and the
synthetic ResNet-50 (``benchmarks.models``) with each convolution a (in x k x k, out)
kernel. Per model and method, as the PyTorch worker: the local compute (the same step with
Keras's SGD on the local gradients) before the method, warm-up steps at the first rate
(the first traces the step), then timed steps at every rate. The bare collectives of a
codec are those of the PyTorch worker's same codec, which hands Horovod the same bytes.
"""

import gc
import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_compress.tf as htf  # noqa: E402
from hvd_compress import cost  # noqa: E402
from hvd_compress.examples.datasets import load_mnist1d  # noqa: E402

from .protocol import (  # noqa: E402
    AUTO_SUFFIX,
    COMPUTE_STEPS,
    STEP_BUDGET_SECONDS,
    TF_PREFIX,
    TIMING_LR,
    Driver,
    difference,
    interface_bytes,
    sent_bytes,
    timed_steps,
    timed_steps_of,
)
from .shapes import (  # noqa: E402
    CLASSES,
    CNN_GLOBAL_BATCH,
    FEATURES,
    RESNET50_INPUTS,
    RESNET50_LOCAL_BATCH,
    resnet50_convolutions,
)

MOMENTUM = 0.9
# Untimed steps before measuring: the first traces the step, the next ones grow the heap.
WARMUP_STEPS = 3
# Horovod's compressor of each of its own methods; the others are TF_PREFIX + a codec name.
HOROVOD = {"tf-hvd-none": hvd.Compression.none, "tf-hvd-fp16": hvd.Compression.fp16}


class SyntheticResNet50(tf.Module):
    """``benchmarks.models.SyntheticResNet50`` in TensorFlow: ResNet-50's parameter tensors
    (each convolution's kernel as Keras stores a dense one, (in x k x k, out)), the same
    arithmetic on an input of (batch, RESNET50_INPUTS)."""

    def __init__(self, seed):
        super().__init__(name="resnet50")
        init = np.random.default_rng(seed)
        self.convs = []
        for index, (out, inplanes, k) in enumerate(resnet50_convolutions()):
            fan_in = inplanes * k * k
            self.convs.append(
                (
                    fan_in,
                    tf.Variable(
                        init.standard_normal((fan_in, out)).astype(np.float32) / fan_in**0.5,
                        name=f"conv{index}/kernel",
                    ),
                    tf.Variable(tf.ones(out), name=f"conv{index}/gamma"),
                    tf.Variable(tf.zeros(out), name=f"conv{index}/beta"),
                )
            )
        bound = FEATURES**-0.5
        self.fc = (
            tf.Variable(
                init.uniform(-bound, bound, (FEATURES, CLASSES)).astype(np.float32),
                name="fc/kernel",
            ),
            tf.Variable(tf.zeros(CLASSES), name="fc/bias"),
        )

    def __call__(self, x):
        features = tf.zeros([tf.shape(x)[0], FEATURES])
        for fan_in, kernel, gamma, beta in self.convs:
            out = x[:, :fan_in] @ kernel * gamma + beta
            features += tf.pad(out, [[0, 0], [0, FEATURES - out.shape[1]]])
        kernel, bias = self.fc
        return tf.nn.relu(features) @ kernel + bias

    @property
    def weights(self):
        return [v for conv in self.convs for v in conv[1:]] + list(self.fc)


class Workload:
    """A TensorFlow model factory and this rank's endless random batches."""

    def __init__(self, name, rank, world_size, seed):
        self.name = name
        self.seed = seed
        if name == "cnn":
            x_train, y_train, _, _ = load_mnist1d()
            self.inputs, self.targets = x_train[rank::world_size], y_train[rank::world_size]
            self.local_batch = CNN_GLOBAL_BATCH // world_size
        elif name == "resnet50":
            generator = np.random.default_rng(seed * 1000 + rank)
            self.inputs = generator.standard_normal(
                (4 * RESNET50_LOCAL_BATCH, RESNET50_INPUTS)
            ).astype(np.float32)
            self.targets = generator.integers(0, CLASSES, len(self.inputs))
            self.local_batch = RESNET50_LOCAL_BATCH
        else:
            raise ValueError(f"model must be 'cnn' or 'resnet50', got {name!r}")

    def build(self):
        """(model, its variables), the same weights on every rank."""
        if self.name == "resnet50":
            model = SyntheticResNet50(self.seed)
            return model, model.weights
        from examples.mnist1d_keras import cnn

        keras.utils.set_random_seed(self.seed)
        model = cnn()
        return model, model.trainable_variables

    def batches(self, seed):
        generator = np.random.default_rng(seed)
        while True:
            index = generator.integers(0, len(self.inputs), self.local_batch)
            yield (
                tf.constant(self.inputs[index]),
                tf.constant(self.targets[index].astype(np.int32)),
            )


class Trainer:
    """One traced SGD step: forward, backward, ``wrap(tape)``'s gradients, Keras's SGD."""

    def __init__(self, work, wrap, world_size):
        self.model, self.variables = work.build()
        self.world_size = world_size
        self.optimizer = keras.optimizers.SGD(TIMING_LR, momentum=MOMENTUM)
        self.tape = None
        # Horovod's tape keys gradients by ``tf.Variable.ref()``, which Keras 3's variables
        # lack: it differentiates the TensorFlow variables behind them.
        sources = [v.value if isinstance(v, keras.Variable) else v for v in self.variables]

        @tf.function
        def step(inputs, targets):
            with tf.GradientTape() as tape:
                logits = self.model(inputs)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
                )
            self.tape = wrap(tape)  # runs while tracing: the tape of every step
            grads = self.tape.gradient(loss, sources)
            self.optimizer.apply_gradients(zip(grads, self.variables))
            return loss

        self._step = step

    def step(self, inputs, targets):
        self._step(inputs, targets).numpy()

    def gradient_bytes(self, itemsize):
        return sum(int(np.prod(v.shape)) for v in self.variables) * itemsize


def codec_trainer(work, codec, world_size, exchange="auto", adaptive=False):
    """The ``Trainer`` of ``hvd_compress.tf``'s tape with ``codec``, ``exchange`` and
    ``adaptive``."""

    def codec_tape(tape):
        return htf.DistributedGradientTape(
            tape, compression=codec, exchange=exchange, adaptive=adaptive
        )

    return Trainer(work, codec_tape, world_size)


def trainer(method, work, world_size):
    """The ``Trainer`` of ``method`` (None: the local step, with no exchange) and its
    (handed, sent) bytes per worker of the last step."""
    if method is None:
        return Trainer(work, lambda tape: tape, world_size), None
    if method in HOROVOD:
        compression = HOROVOD[method]

        def horovod_tape(tape):
            return hvd.DistributedGradientTape(tape, compression=compression)

        run = Trainer(work, horovod_tape, world_size)

        def horovod_bytes():
            handed = run.gradient_bytes(2 if compression is hvd.Compression.fp16 else 4)
            return handed, cost.allreduce_traffic(handed, world_size).sent

        return run, horovod_bytes
    codec = method[len(TF_PREFIX) :]
    adaptive = codec.endswith(AUTO_SUFFIX)
    if adaptive:
        codec = codec[: -len(AUTO_SUFFIX)]
    run = codec_trainer(work, codec, world_size, adaptive=adaptive)

    def codec_bytes():
        pipeline = run.tape.pipeline
        stats = pipeline.compression_stats()
        return stats["bytes_handed"], sent_bytes(pipeline.codec, stats, world_size)

    return run, codec_bytes


def measure_compute(driver, work, local, batches, method):
    """The step with no exchange before each method, as ``benchmarks.worker``'s, by the
    model's ``local`` trainer: traced once, not again before every method."""
    timed_steps(local, batches, WARMUP_STEPS)
    seconds = []
    for _ in range(COMPUTE_STEPS):
        driver.barrier()
        seconds += timed_steps(local, batches, 1)
    driver.emit("compute", model=work.name, method=method, seconds=statistics.median(seconds))


def measure_method(driver, work, batches, method, rates, steps, interface):
    """Warm-up at the first rate, then timed steps at every rate. An adaptive method (as
    ``benchmarks.worker``'s) starts anew at every rate, for the link it measures: its
    warm-up and decision, then the steps of its trials, before any is timed; its timed
    steps take turns with steps of its codec forced on every tensor (``_beside_forced``)."""
    run = forced = None
    adaptive = method.endswith(AUTO_SUFFIX)
    for rate in rates:
        driver.shape(rate)
        if run is None or adaptive:
            run, sizes = trainer(method, work, hvd.size())
            warmup = htf.Adaptive().warmup_steps + 1 if adaptive else WARMUP_STEPS
            timed_steps(run, batches, warmup)
            # The same on every rank: the decisions are agreed.
            while adaptive and run.tape.pipeline.compression_stats()["adaptive"].get("judging"):
                timed_steps(run, batches, 1)
        extra = {}
        if adaptive:
            if forced is None:
                forced, _ = trainer(method[: -len(AUTO_SUFFIX)], work, hvd.size())
                timed_steps(forced, batches, WARMUP_STEPS)
            driver.barrier()
            seconds, extra["forced_step_seconds"], (tx, rx) = _beside_forced(
                driver, run, forced, batches, steps, interface
            )
            extra["adaptive"] = run.tape.pipeline.compression_stats()["adaptive"]
        else:
            driver.barrier()
            before = interface_bytes(interface)
            seconds = timed_steps_of(driver, run, batches, steps)
            driver.barrier()  # as benchmarks.worker: the last step's bytes are counted
            tx, rx = difference(interface_bytes(interface), before, len(seconds))
        handed, sent = sizes()
        driver.emit(
            "step",
            model=work.name,
            method=method,
            rate=rate,
            step_seconds=seconds,
            seconds=statistics.median(seconds),
            handed=handed,
            sent=sent,
            wire_tx=tx,
            wire_rx=rx,
            **extra,
        )
    del run, forced
    gc.collect()


def _beside_forced(driver, run, forced, batches, steps, interface):
    """``timed_steps_of`` the adaptive ``run``, each of its steps followed by one of
    ``forced`` (its codec on every tensor): (``run``'s seconds, ``forced``'s, per-step
    bytes of ``run``'s steps on the interface). Side by side, so that no drift of the
    machine's speed between two configurations enters their ratio, which is within noise
    of 1 where the adaptive mode keeps every tensor on its codec."""
    forced_seconds, wire = [], []  # wire: each of run's steps' (tx, rx) bytes

    def measure():
        before = interface_bytes(interface)
        (seconds,) = timed_steps(run, batches, 1)
        driver.barrier()  # the step's bytes are all counted, and no rank is behind
        wire.append(difference(interface_bytes(interface), before, 1))
        forced_seconds.extend(timed_steps(forced, batches, 1))
        driver.barrier()
        return seconds

    least, most = steps
    seconds = driver.repeated(measure, least, most, STEP_BUDGET_SECONDS)
    tx, rx = zip(*wire)
    if tx[0] is None:
        return seconds, forced_seconds, (None, None)
    return seconds, forced_seconds, (statistics.mean(tx), statistics.mean(rx))


def _largest(name, value):
    """The largest of the ranks' ``value`` (``Driver``'s allreduce)."""
    total = hvd.allreduce(tf.constant([value], tf.float64), name=name, op=hvd.Max)
    return float(total.numpy()[0])


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    driver = Driver(hvd.rank(), hvd.size(), _largest, os.path.dirname(spec_path))
    interface = os.environ.get("HOROVOD_GLOO_IFACE")
    driver.barrier()
    for model in spec["models"]:
        work = Workload(model, hvd.rank(), hvd.size(), spec["seed"])
        batches = work.batches(spec["seed"] * 1000 + hvd.rank())
        local, _ = trainer(None, work, hvd.size())
        for method in spec["tf_methods"]:
            measure_compute(driver, work, local, batches, method)
            measure_method(
                driver, work, batches, method, spec["rates"], spec["steps"][model], interface
            )
    driver.emit("done")


if __name__ == "__main__":
    main(sys.argv[1])
