"""ScaleCom's CLT-k: exact top-k selection (reference and PyTorch port), and real Horovod jobs
where every rank uses the rotating leader's indices, against the numpy reference."""

import numpy as np
import pytest
import torch

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress import cost

from .devices import DEVICES
from .harness import run_parallel
from .pt_jobs import replay_clt_k, train_sparse


@pytest.mark.parametrize("numel,k", [(1000, 10), (1000, 1), (7, 7), (513, 100)])
@pytest.mark.parametrize("device", DEVICES)
def test_top_k_is_exact_with_ties_and_nan(numel, k, device):
    reference, port = hvd_compress.CyclicLocalTopK(), hc.CyclicLocalTopK()
    rng = np.random.default_rng(numel + k)
    for values in (
        rng.standard_normal(numel),
        np.round(rng.standard_normal(numel)),
        np.where(rng.random(numel) < 0.01, np.nan, rng.standard_normal(numel)),
    ):
        values = values.astype(np.float32)
        indices = reference.top_k(values, k)
        # Largest magnitudes first (NaN largest), ties to the lower index; sent ascending.
        magnitude = np.where(np.isnan(values), np.inf, np.abs(values))
        expected = np.sort(np.lexsort((np.arange(numel), -magnitude))[:k])
        np.testing.assert_array_equal(indices, expected)
        indices_pt = port.top_k(torch.from_numpy(values).to(device), k)
        np.testing.assert_array_equal(indices_pt.cpu().numpy(), indices)


def test_bad_hyperparameters_and_misuse():
    with pytest.raises(ValueError, match="ratio must be >= 1"):
        hc.CyclicLocalTopK(ratio=0)
    with pytest.raises(ValueError, match=r"beta must be in \(0, 1\]"):
        hc.CyclicLocalTopK(beta=0)
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\]"):
        hc.CyclicLocalTopK(beta=1.5)
    with pytest.raises(TypeError, match="beta must be a real number"):
        hc.CyclicLocalTopK(beta="0.5")
    with pytest.raises(TypeError, match="Horovod's own DistributedOptimizer"):
        hc.CyclicLocalTopK().compress(torch.ones(3))
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="cannot travel by exchange='allgather'"):
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), compression="clt-k", exchange="allgather"
        )


def test_traffic_is_k_indices_and_k_values_whatever_the_world_size():
    codec = hvd_compress.CyclicLocalTopK(ratio=100)
    for world in (2, 4, 64):
        traffic = cost.compressed_traffic(codec, 100_000, world, "allreduce")
        assert traffic.handed == 4 * 1000 + 4 * 1000
        assert traffic.sent < 3 * 4 * 1000
    assert cost.choose_exchanges(codec, [100_000], 8) == ["allreduce"]


@pytest.mark.multiprocess
def test_one_worker_is_top_k_with_error_feedback():
    codec = hvd_compress.CyclicLocalTopK(ratio=20, min_size=0)
    results = run_parallel(train_sparse, 1, codec)
    replay_clt_k(results, codec)
    # sum_t sent_t + m_T = sum_t g_t (beta = 1: plain error feedback).
    records = results[0]["records"]
    for name, memory in results[0]["memory"].items():
        sent = sum(r["exchanged"][name] for r in records)
        total = sum(r["local"][name] for r in records)
        torch.testing.assert_close(sent + memory.reshape(sent.shape), total, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_use_the_rotating_leaders_indices(world):
    codec = hvd_compress.CyclicLocalTopK(ratio=10, beta=0.5, min_size=0)
    results = run_parallel(train_sparse, world, codec, steps=2 * world)
    chosen = replay_clt_k(results, codec)
    # The workers' own top-k differ, so whose indices were used is observable: the reference
    # above used the leader's (rank step mod N), and another choice would not have matched.
    for step, indices in enumerate(chosen):
        assert any(
            not np.array_equal(own[step % world], own[(step + 1) % world])
            for own in indices.values()
        )
