"""The PyTorch DistributedOptimizer in real Horovod jobs of 2 and 4 processes over Gloo."""

import pytest
import torch

import hvd_compress

from .devices import rank_device
from .harness import run_parallel
from .pt_jobs import TERNGRAD, Net, check_consistent_and_exact, flat, train, train_side_by_side

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("exchange", ["allreduce", "allgather", "sharded", "auto"])
def test_terngrad_ranks_agree_and_match_reference(world, exchange):
    results = run_parallel(train, world, hvd_compress.TernGrad(**TERNGRAD), exchange)
    tensors = {name: (ex, reason) for name, _, ex, reason in results[0]["tensors"]}
    assert (
        tensors["hidden.weight"][1] == "compressed" and tensors["middle.weight"][1] == "compressed"
    )
    assert tensors["out.weight"][1] == "excluded"  # the classifier
    assert tensors["hidden.bias"][1].endswith("< min_size 1000")
    if exchange == "auto":
        # 10240 elements: at N = 4 sharded would save 1.9 kB, less than its alltoall costs.
        assert tensors["hidden.weight"][0] == "allgather"
    check_consistent_and_exact(results, hvd_compress.TernGrad(**TERNGRAD))


QSGD_FAMILY = [
    hvd_compress.QSGDInf(bits=4, bucket_size=512, min_size=1000),
    hvd_compress.NUQSGD(bits=4, bucket_size=2048, min_size=1000),
    hvd_compress.QSGD(bits=3, bucket_size=700, min_size=1000),
]


def _train_many(configs):
    return [train(codec, exchange) for codec, exchange in configs]


@pytest.mark.parametrize("world", [2, 4])
def test_qsgd_family_ranks_agree_and_match_reference(world):
    configs = [
        (codec, exchange)
        for codec in QSGD_FAMILY
        for exchange in ("allgather", "allreduce", "sharded", "auto")
    ]
    configs += [(hvd_compress.NUQSGD(bucket_size=1000, min_size=1000, wire="elias"), "auto")]
    per_rank = run_parallel(_train_many, world, configs)
    for (codec, _exchange), results in zip(configs, zip(*per_rank)):
        check_consistent_and_exact(list(results), codec)


def test_fp16_and_sum_op_and_accumulation():
    codec = hvd_compress.FP16()
    for exchange in ("allreduce", "sharded"):
        results = run_parallel(train, 2, codec, exchange, passes=2)
        check_consistent_and_exact(results, codec)
    results = run_parallel(train, 2, hvd_compress.TernGrad(**TERNGRAD), "allgather", op="sum")
    check_consistent_and_exact(results, hvd_compress.TernGrad(**TERNGRAD), average=False)


def test_backward_passes_and_clipping_through_synchronize():
    results = run_parallel(
        train, 2, hvd_compress.TernGrad(**TERNGRAD), "sharded", steps=3, passes=2, clip_norm=0.05
    )
    check_consistent_and_exact(results, hvd_compress.TernGrad(**TERNGRAD))
    # Clipping acted on the exchanged gradient: the step moved the weights by at most
    # lr * clip_norm * (1 + momentum terms) in norm.
    for r in results:
        first_step = r["records"][0]["params"]
        assert torch.isfinite(first_step).all()


def _compare_with_horovod(steps=4):
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    opt_ours = hc.DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9),
        ours.named_parameters(),
        compression="none",
    )
    opt_theirs = hvd.DistributedOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9), theirs.named_parameters()
    )
    return train_side_by_side([(ours, opt_ours), (theirs, opt_theirs)], steps, hvd.rank())


def test_none_matches_horovods_own_optimizer():
    for ours, theirs in run_parallel(_compare_with_horovod, 2):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def _broadcast_after_checkpoint(tmpdir):
    """Rank 0 alone loads a checkpoint (with momentum state), then the usual broadcasts."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights on every rank
    model = Net()
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression="terngrad",
    )
    if hvd.rank() == 0:
        checkpoint = torch.load(f"{tmpdir}/checkpoint.pt", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()
    momentum = torch.cat([s["momentum_buffer"].reshape(-1) for s in state["state"].values()])
    data = torch.Generator().manual_seed(hvd.rank())
    for _ in range(2):
        optimizer.zero_grad()
        x = torch.randn(8, 64, generator=data)
        torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        optimizer.step()
    return momentum, flat(model), state["hvd_compress"]["step"]


def test_broadcasts_after_rank0_loads_checkpoint(tmp_path):
    torch.manual_seed(42)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.nn.functional.cross_entropy(
        model(torch.randn(4, 64)), torch.zeros(4, dtype=torch.long)
    ).backward()
    optimizer.step()
    state = optimizer.state_dict()
    state["hvd_compress"] = {"step": 7}
    torch.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "checkpoint.pt")
    saved = torch.cat([s["momentum_buffer"].reshape(-1) for s in optimizer.state.values()])
    results = run_parallel(_broadcast_after_checkpoint, 2, str(tmp_path), timeout=120)
    for momentum, params, _ in results:
        assert torch.equal(momentum, saved)
        assert torch.equal(params, results[0][1])
    assert results[0][2] == 7


def test_nan_on_one_rank_reaches_every_rank():
    results = run_parallel(
        train, 2, hvd_compress.TernGrad(**TERNGRAD), "allgather", steps=3, nan_at=1
    )
    for r in results:
        exchanged = r["records"][1]["exchanged"]["hidden.weight"]
        assert torch.isnan(exchanged).all()
        assert torch.isfinite(r["records"][0]["exchanged"]["hidden.weight"]).all()
    assert torch.equal(
        results[0]["records"][2]["params"].isnan(), results[1]["records"][2]["params"].isnan()
    )


def _misuse_and_sparse():
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 8, sparse=True)
    head = torch.nn.Linear(8, 2)
    hvd.broadcast_parameters(embedding.state_dict(), 0)
    hvd.broadcast_parameters(head.state_dict(), 0)
    params = list(embedding.parameters()) + list(head.parameters())
    named = [("embedding.weight", params[0]), ("head.weight", params[1]), ("head.bias", params[2])]
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.5), named, compression=hc.TernGrad(min_size=0)
    )
    errors = []

    def loss():
        tokens = torch.tensor([hvd.rank(), 3, 7 + hvd.rank()])
        return head(embedding(tokens)).sum()

    loss().backward()
    try:
        optimizer.zero_grad()
    except RuntimeError as error:
        errors.append(str(error))
    try:
        loss().backward()
    except RuntimeError as error:
        errors.append(str(error))
    optimizer.step()
    return errors, embedding.weight.detach().clone(), head.weight.detach().clone()


def test_misuse_errors_and_sparse_gradients():
    results = run_parallel(_misuse_and_sparse, 2, timeout=120)
    for errors, embedding, head in results:
        assert "zero_grad() was called after loss.backward()" in errors[0]
        assert "more than backward_passes_per_step=1 times" in errors[1]
        assert torch.equal(embedding, results[0][1]) and torch.equal(head, results[0][2])
    # Rows 0, 1, 3, 7 and 8 were looked up on some rank; row 20 on none.
    torch.manual_seed(0)
    before = torch.nn.Embedding(50, 8, sparse=True).weight.detach()
    changed = (results[0][1] != before).any(1).nonzero().reshape(-1).tolist()
    assert changed == [0, 1, 3, 7, 8]


def _wait_for_late_rank():
    import time

    import horovod.torch as hvd

    from hvd_compress.pt.exchange import wait

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(1.0)
    handle = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="late")
    cpu, start = time.thread_time(), time.perf_counter()
    total = wait(handle)
    return time.thread_time() - cpu, time.perf_counter() - start, total.tolist()


def test_waiting_for_a_late_rank_leaves_the_core_free():
    # Horovod's synchronize would spend about the whole second on rank 0's core; with more
    # ranks than cores that CPU is taken from the ranks still encoding.
    (cpu, waited, total), _ = run_parallel(_wait_for_late_rank, 2, timeout=120)
    assert total == [2.0] * 4
    assert waited > 0.5
    assert cpu < 0.1 * waited, (cpu, waited)


def _backward_without_host_syncs(compression):
    """A second step of ``compression`` on this rank's GPU, its backward pass (whose hooks
    encode the gradients and start their exchanges) under CUDA's sync debug mode set to raise
    on any wait of the host for the device. The first step settles what happens once."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    device = rank_device("cuda")
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=compression,
    )
    x = torch.randn(8, 64, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    for checked in (False, True):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        optimizer.step()
    return [reason for _, _, _, reason in optimizer.compression_stats()["tensors"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("compression", ["terngrad", "qsgd-inf", "ef-sign"])
def test_gradient_hooks_do_not_wait_for_the_gpu(compression):
    # One rank is enough: the pipeline's hooks exchange at N = 1 as at any N.
    (reasons,) = run_parallel(_backward_without_host_syncs, 1, compression, timeout=120)
    assert "compressed" in reasons
