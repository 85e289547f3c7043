"""The TensorFlow ports of the sparse codecs, AdaComp and ScaleCom's CLT-k: AdaComp's messages
byte for byte against the numpy reference and the PyTorch port, CLT-k's exact top-k, layer
kinds of a Keras model, and real Horovod jobs of 2 and 4 processes where a
``DistributedGradientTape`` loop keeps every rank bitwise equal after every step and matches
the numpy reference replayed from every rank's local gradients.

Every TensorFlow body runs in child processes only (see ``test_tf_codecs``): this module
imports neither framework at module level, and the PyTorch side is imported inside the tests.
"""

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel
from .tf_jobs import (
    CLT_K,
    assert_sparse_ranks_agree,
    check_clt_k,
    compressed_names,
    sparse_tape_loop,
)

pytestmark = pytest.mark.multiprocess

# (numel, L_T, step with a NaN or an Inf in the gradient or None); step 0 has zero bins.
ADACOMP_CASES = [
    (1234, 50, None),
    (5000, 500, None),
    (7, 50, None),
    (1, 1, None),
    (100, 7, None),
    (512, 64, None),
    (3000, 9, 4),
    (777, 100, 2),
]
ADACOMP_STEPS = 8
TOP_K_CASES = [(1000, 10), (1000, 1), (7, 7), (513, 100), (20_000, 400)]


def _gradients(numel, steps, seed, bad_step):
    """Gradients with a trend and noise, a zero stretch (whole zero bins) at first, and a NaN
    (odd seeds) or an Inf at ``bad_step``."""
    rng = np.random.default_rng(seed)
    trend = rng.standard_normal(numel).astype(np.float32)
    grads = [(trend + rng.standard_normal(numel)).astype(np.float32) for _ in range(steps)]
    grads[0][: min(numel, 120)] = 0
    if bad_step is not None:
        grads[bad_step][numel // 3] = np.nan if seed % 2 else np.inf
    return grads


def _adacomp_inputs():
    return [
        (numel, bin_length, _gradients(numel, ADACOMP_STEPS, numel + bin_length, bad))
        for numel, bin_length, bad in ADACOMP_CASES
    ]


def _top_k_inputs(numel, k):
    rng = np.random.default_rng(numel + k)
    return [
        values.astype(np.float32)
        for values in (
            rng.standard_normal(numel),
            np.round(rng.standard_normal(numel)),
            np.where(rng.random(numel) < 0.01, np.nan, rng.standard_normal(numel)),
        )
    ]


def _tf_cases(adacomp_inputs, top_k_cases):
    """In TensorFlow, eager and traced: AdaComp's residue loop (messages and sent values of
    every step), CLT-k's indices, layer kinds and misuse errors."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    codec, clt = htf.AdaComp(), htf.CyclicLocalTopK()
    results = {"adacomp": [], "top_k": [], "errors": []}
    for numel, bin_length, grads in adacomp_inputs:

        def step(compensated, grad, bin_length=bin_length, numel=numel):
            selected = codec.select(compensated, grad, bin_length)
            message = codec.encode_message(compensated, selected, bin_length)
            return message, codec.decode_message(message, numel, bin_length)

        runs = {}
        for mode, run in (("eager", step), ("traced", tf.function(step))):
            residue, steps = tf.zeros([numel]), []
            for grad in grads:
                compensated = residue + grad
                message, sent = run(compensated, tf.constant(grad))
                residue = compensated - sent
                steps.append((message.numpy(), sent.numpy()))
            runs[mode] = steps
        results["adacomp"].append(runs)
    for numel, k in top_k_cases:
        traced = tf.function(lambda values, k=k: clt.top_k(values, k))
        results["top_k"].append(
            [
                {
                    "eager": clt.top_k(tf.constant(v), k).numpy(),
                    "traced": traced(tf.constant(v)).numpy(),
                }
                for v in _top_k_inputs(numel, k)
            ]
        )

    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Embedding(30, 8),
            keras.layers.Conv1D(4, 3),
            keras.layers.GRU(6),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2),
        ]
    )
    adacomp = htf.AdaComp.for_model(model, min_size=0)
    optimizer = htf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=adacomp)
    optimizer.build(model.trainable_variables)
    results["kinds"] = adacomp.layers
    results["plans"] = {plan.name: plan.layer for plan in optimizer._hvdc_pipeline.plans}
    misuse = [
        lambda: htf.AdaComp().compress(tf.zeros(3)),
        lambda: htf.CyclicLocalTopK().compress(tf.zeros(3)),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="adacomp", error_feedback=False
        ),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="clt-k", exchange="allgather"
        ),
    ]
    for call in misuse:
        try:
            call()
        except (TypeError, ValueError) as error:
            results["errors"].append(str(error))
    return results


@pytest.fixture(scope="module")
def tf_results():
    return run_parallel(_tf_cases, 1, _adacomp_inputs(), TOP_K_CASES, timeout=600)[0]


@pytest.mark.parametrize(
    "case", range(len(ADACOMP_CASES)), ids=[f"{n}/{b}/{bad}" for n, b, bad in ADACOMP_CASES]
)
def test_adacomp_messages_equal_numpy_and_pytorch(tf_results, case):
    import torch

    import hvd_compress.pt as hc

    from .pt_jobs import adacomp_replay

    numel, bin_length, grads = _adacomp_inputs()[case]
    reference, port = hvd_compress.AdaComp(), hc.AdaComp()
    _, steps = adacomp_replay(reference, grads, bin_length)
    residue = torch.zeros(numel)
    for step, (grad, (_compensated, _, _selected, message, sent)) in enumerate(zip(grads, steps)):
        grad = torch.from_numpy(grad)
        torch_compensated = residue + grad
        torch_message = port.encode_message(
            torch_compensated, port.select(torch_compensated, grad, bin_length), bin_length
        )
        residue = torch_compensated - port.decode_message(torch_message, numel, bin_length)
        np.testing.assert_array_equal(torch_message.numpy(), message)
        for mode, got in tf_results["adacomp"][case].items():
            got_message, got_sent = got[step]
            np.testing.assert_array_equal(got_message, message, err_msg=f"{mode} step {step}")
            np.testing.assert_array_equal(got_sent, sent, err_msg=f"{mode} step {step}")
    # The cases cover zero bins (which send nothing) and non-finite messages.
    assert not steps[0][2][: min(numel, 120)].any()
    if ADACOMP_CASES[case][2] is not None:
        assert np.isnan(steps[-1][4]).all()


@pytest.mark.parametrize("case", range(len(TOP_K_CASES)), ids=[f"{n}/{k}" for n, k in TOP_K_CASES])
def test_top_k_equals_numpy_and_pytorch(tf_results, case):
    import torch

    import hvd_compress.pt as hc

    numel, k = TOP_K_CASES[case]
    reference, port = hvd_compress.CyclicLocalTopK(), hc.CyclicLocalTopK()
    for values, got in zip(_top_k_inputs(numel, k), tf_results["top_k"][case]):
        want = reference.top_k(values, k)
        np.testing.assert_array_equal(port.top_k(torch.from_numpy(values), k).numpy(), want)
        for mode, indices in got.items():
            assert indices.dtype == np.int32
            np.testing.assert_array_equal(indices, want, err_msg=mode)


def test_layer_kinds_of_a_keras_model_and_misuse(tf_results):
    kinds = tf_results["kinds"]
    by_layer = {}
    for name, kind in kinds.items():
        by_layer.setdefault(name.split("/")[1], set()).add(kind)
    assert by_layer == {
        "embedding": {"embedding"},
        "conv1d": {"conv"},
        "gru": {"recurrent"},
        "layer_normalization": {"other"},
        "dense": {"linear"},
    }, kinds
    assert len(kinds) == 1 + 2 + 3 + 2 + 2
    # The names are those of the wrappers' plans, so the kinds reach them.
    assert tf_results["plans"] == kinds
    compress, compress_clt, no_memory, exchange = tf_results["errors"]
    assert "AdaComp cannot run inside Horovod's own DistributedOptimizer" in compress
    assert "compression='clt-k'" in compress_clt
    assert "adacomp chooses what to send from its error-feedback memory" in no_memory
    assert "clt-k codes cannot travel by exchange='allgather'" in exchange


# ----- real Horovod jobs -----

ADACOMP = hvd_compress.AdaComp(
    named_bin_lengths={"middle/kernel:0": 64}, bin_lengths={"other": 20}, min_size=0
)


def _check_adacomp(results):
    """Replays AdaComp in numpy (``pt_jobs.adacomp_replay``) from every rank's local
    gradients."""
    from .pt_jobs import adacomp_replay

    kinds = results[0]["kinds"]
    for name in compressed_names(results):
        bin_length = ADACOMP.bin_length(name, kinds[name])
        replays = [
            adacomp_replay(
                ADACOMP, [record["local"][name].ravel() for record in r["records"]], bin_length
            )
            for r in results
        ]
        for step, first in enumerate(results[0]["records"]):
            total = sum(steps[step][4] for _, steps in replays)  # every rank's sent values
            np.testing.assert_allclose(
                first["exchanged"][name].ravel(),
                total / len(results),
                rtol=1e-6,
                atol=1e-9,
                err_msg=f"{name} step {step}",
            )
        for r, (residue, _) in zip(results, replays):
            np.testing.assert_allclose(r["memory"][name], residue, rtol=1e-6, atol=1e-9)
    for r in results:
        for record in r["records"]:
            assert record["bytes"] == record["expected"]
            layers = record["layers"]
            assert sum(layer["bytes_handed"] for layer in layers.values()) == record["bytes"]
            assert 0 < layers["linear"]["density"] < 0.5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "codec,check", [(ADACOMP, _check_adacomp), (CLT_K, check_clt_k)], ids=["adacomp", "clt-k"]
)
def test_tape_loop_ranks_agree_and_match_reference(world, codec, check):
    # One job per size: eagerly at 2 ranks, traced at 4 (with the output layer sent whole).
    traced = world == 4
    results = run_parallel(sparse_tape_loop, world, codec, 2 * world, traced, timeout=800)
    names = compressed_names(results)
    assert "hidden/kernel:0" in names and ("out/kernel:0" in names) != traced
    assert_sparse_ranks_agree(results)
    check(results)
