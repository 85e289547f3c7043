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
    for index, (name, numel, exchange, reason) in enumerate(results[0]["tensors"]):
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
