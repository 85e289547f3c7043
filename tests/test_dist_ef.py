"""dist-EF-blockSGD(M): the BlockSign compressor, worker and server error feedback, and the
worker-momentum optimizer mode, in real Horovod jobs."""

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import cost

from .devices import DEVICES
from .harness import run_parallel
from .pt_jobs import Net, train_ef, train_side_by_side, virtual_iterate_gap


@pytest.mark.parametrize("block", [None, 100, 7])
def test_compressor_identity(block):
    codec = hvd_compress.BlockSign(max_block_size=block)
    p = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    p[[3, 500]] = 0
    scale = codec.local_scale(p)
    decoded = codec.decode(codec.encode(p, scale, None), scale, 1).astype(np.float64)
    size = codec.bucket_length(p.size)
    blocks = [p[i : i + size].astype(np.float64) for i in range(0, p.size, size)]
    # ||C(p) - p||^2 = ||p||^2 - sum_b ||p_b||_1^2 / |G_b|, and ||C(p)_b||_1 = ||p_b||_1.
    np.testing.assert_allclose(
        np.sum((decoded - p) ** 2),
        np.sum(p.astype(np.float64) ** 2) - sum(np.abs(b).sum() ** 2 / b.size for b in blocks),
        rtol=1e-6,
    )
    for i, b in enumerate(blocks):
        np.testing.assert_allclose(
            np.abs(decoded[i * size : i * size + b.size]).sum(), np.abs(b).sum(), rtol=1e-6
        )
    assert decoded[3] > 0 and decoded[500] > 0  # sign(0) = +1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [None, 256, 4096, 5000])
def test_port_scales_match_the_float64_reference(block, device):
    # The port sums |p| in float32 runs of 4,096 added in float64; the reference sums in
    # float64. Lengths around a run's and a block's end, half-precision inputs, and a NaN
    # or Inf that marks every block.
    import hvd_compress.pt as hc

    port, reference = hc.BlockSign(block), hvd_compress.BlockSign(block)
    rng = np.random.default_rng(0)
    for numel in (1024, 4095, 4097, 12_289, 1_000_003):
        g = (rng.standard_normal(numel) * 1e3).astype(np.float32)
        for dtype in (torch.float32, torch.float16, torch.float64):
            x = torch.from_numpy(g).to(dtype)
            want = reference.local_scale(x.numpy())
            got = port.local_scale(x.to(device))
            assert got.dtype == torch.float32 and got.shape == want.shape
            np.testing.assert_allclose(got.cpu().numpy(), want, rtol=3e-7)
        for bad in (np.nan, np.inf, -np.inf):
            x = g.copy()
            x[numel // 3] = bad
            np.testing.assert_array_equal(
                port.local_scale(torch.from_numpy(x).to(device)).cpu().numpy(),
                reference.local_scale(x),
            )


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 4])
def test_two_way_error_feedback_invariant_and_rank_consistency(world):
    for exchange in ("allgather", "sharded"):
        results = run_parallel(train_ef, world, exchange)
        for step in range(len(results[0]["params"])):
            for r in results[1:]:
                assert torch.equal(r["params"][step], results[0]["params"][step]), step
        assert virtual_iterate_gap(results, exchange) < 1e-5
        for r in results:
            assert all(h == r["expected"] for h in r["handed"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("codec", ["terngrad", "qsgd-inf"])
def test_error_feedback_with_any_codec_keeps_what_was_not_sent(codec):
    """x_T - mean_i e_T,i = x_0 - sum_t eta_t mean_i g_t,i for one-way codecs with worker
    error feedback and an LR drop (plain SGD, so u = g)."""
    results = run_parallel(train_ef, 2, "auto", 50, 25, codec, 0.0, False)
    for r in results[1:]:
        assert torch.equal(r["params"][-1], results[0]["params"][-1])
    assert results[0]["worker"], "no tensor was compressed"
    assert virtual_iterate_gap(results, "auto", mu=0.0) < 1e-5


def _identity_against_sgd(steps=10):
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    torch.manual_seed(0)
    ours, forced, theirs = Net(), Net(), Net()
    forced.load_state_dict(ours.state_dict())
    theirs.load_state_dict(ours.state_dict())
    settings = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    opt_ours = hc.DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), **settings),
        ours.named_parameters(),
        compression="none",
        worker_momentum=True,
    )
    # A heavy-ball SGD whose worker momentum takes Nesterov's form (ef-sign's default there)
    opt_forced = hc.DistributedOptimizer(
        torch.optim.SGD(forced.parameters(), **{**settings, "nesterov": False}),
        forced.named_parameters(),
        compression="none",
        worker_momentum="nesterov",
    )
    opt_theirs = torch.optim.SGD(theirs.parameters(), **settings)
    return train_side_by_side(
        [(ours, opt_ours), (forced, opt_forced), (theirs, opt_theirs)], steps, 0
    )


@pytest.mark.multiprocess
def test_identity_codec_at_one_worker_is_nesterov_sgd():
    ((ours, forced, theirs),) = run_parallel(_identity_against_sgd, 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(forced, theirs, rtol=1e-5, atol=1e-6)


def test_sharded_bytes_stay_flat_from_two_to_four_workers():
    codec = hvd_compress.BlockSign()
    n = 10_000_000
    sent = {world: cost.compressed_traffic(codec, n, world, "sharded").sent for world in (2, 4, 8)}
    one_way = n / 8
    # On the wire, each way (N - 1) / N of the signs: 2 (N - 1) / N x n / 8 in all, never
    # more than 2 x n / 8 (an allgather of the signs would send (N - 1) x n / 8).
    for world, value in sent.items():
        assert value == pytest.approx(2 * (world - 1) / world * one_way, rel=1e-3)
    # Handed to Horovod: all n / 8 bytes of signs to the alltoall, with the block scale in
    # each of the N shards, and one shard (n / 8N bytes + a scale) to the allgather.
    handed = {world: cost.compressed_traffic(codec, n, world, "sharded").handed for world in (2, 4)}
    assert handed[4] == 4 * (4 + n // 32) + 4 + n // 32
    assert handed[4] <= handed[2] <= 2 * (one_way + 4 * 2)


def test_bad_block_size_and_exchange():
    import hvd_compress.pt as hc

    with pytest.raises(ValueError, match="max_block_size must be >= 1"):
        hc.BlockSign(max_block_size=0)
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="cannot travel by exchange='allreduce'"):
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), compression="ef-sign", exchange="allreduce"
        )
    with pytest.raises(TypeError, match="worker_momentum needs a torch.optim.SGD"):
        hc.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), compression="ef-sign", worker_momentum=True
        )
