"""The adaptive mode in real Horovod jobs: the same decisions on every rank, pins, a late
rank at the probe, and error feedback kept whole when a tensor leaves its codec."""

import pytest
import torch

from hvd_compress.adaptive import TRIAL_STEPS

from .devices import DEVICES, rank_device
from .harness import run_parallel
from .pt_jobs import Net, random_batch

pytestmark = pytest.mark.multiprocess

# Step 2 ends in a decision (warm-up of 2); each trial that follows (the decision's, if it
# changed paths; a challenger's, if it did not or its trial fell) takes TRIAL_STEPS (the
# least trial, trial_seconds=0), and EVERY = 3 steps after the last the next decision
# comes, by step 29.
WARMUP, EVERY = 2, 3
STEPS = WARMUP + 2 * TRIAL_STEPS + EVERY
LATE_SECONDS = 1.5


def _adaptive_run():
    """TernGrad with adaptive decisions; rank 1 arrives late at the first decision."""
    import time

    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression=hc.TernGrad(min_size=1000, compress_classifier=False),
        adaptive=hc.Adaptive(
            warmup_steps=WARMUP, every=EVERY, pin={"middle.weight": "codec"}, trial_seconds=0
        ),
    )
    data = torch.Generator().manual_seed(100 + hvd.rank())
    reports, routes = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = random_batch(data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step == WARMUP - 1 and hvd.rank() == 1:
            time.sleep(LATE_SECONDS)
        optimizer.step()
        stats = optimizer.compression_stats()
        reports.append(stats["adaptive"])
        routes.append({name: route for name, _, route, _ in stats["tensors"]})
    return {
        "reports": reports,
        "routes": routes,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def _leave_codec(codec, exchange, switch_at=3, steps=5):
    """ef-sign (worker and server residuals) whose large tensor leaves the codec for fp32
    after ``switch_at`` steps, as a decision would send it; returns every step's local
    gradients and exchanged averages of that tensor."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = []
    model.hidden.weight.register_post_accumulate_grad_hook(
        lambda p: local.append(p.grad.detach().clone())
    )
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        compression=codec,
        exchange=exchange,
        adaptive=hc.Adaptive(warmup_steps=100, pin={}),
    )
    pipeline = optimizer._hvdc_pipeline
    data = torch.Generator().manual_seed(200 + hvd.rank())
    exchanged, residuals = [], []
    for step in range(steps):
        if step == switch_at:
            pipeline.state.planner.paths["hidden.weight"] = "fp32"
            pipeline.follow_paths()
        optimizer.zero_grad()
        x, y = random_batch(data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.synchronize()
        exchanged.append(model.hidden.weight.grad.detach().clone())
        residuals.append(
            sorted(
                name
                for memory in (pipeline.state.worker, pipeline.state.server)
                for name in memory.residuals
            )
        )
        with optimizer.skip_synchronize():
            optimizer.step()
    return {"local": local, "exchanged": exchanged, "residuals": residuals}


def _leave_codec_runs():
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    return {
        exchange: _leave_codec(hc.BlockSign(min_size=1000), exchange)
        for exchange in ("allgather", "sharded")
    }


def _warm_up_costs(device_kind):
    """The planner's costs after a warm-up of two steps on this rank's ``device_kind``."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    device = rank_device(device_kind)
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression=hc.TernGrad(min_size=1000, compress_classifier=False),
        adaptive=hc.Adaptive(warmup_steps=2, every=100),
    )
    for _ in range(2):
        optimizer.zero_grad()
        x = torch.randn(8, 64, device=device)
        torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        optimizer.step()
    return dict(optimizer._hvdc_pipeline.state.planner.cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_the_warm_up_measures_each_compressed_tensor_on_its_device(device):
    """The codec's work before and after its collectives is measured for every compressed
    tensor: by the thread's CPU time on CPU, by CUDA events on a GPU (the device's time)."""
    costs = run_parallel(_warm_up_costs, 2, device)[0]
    for name in ("hidden.weight", "middle.weight"):
        for phase in ("before", "after"):
            assert costs[name, "codec", phase] > 0, (name, phase, costs)


@pytest.fixture(scope="module")
def adaptive_runs():
    return run_parallel(_adaptive_run, 2, timeout=240)


def test_every_rank_takes_the_same_decisions(adaptive_runs):
    first, second = adaptive_runs
    assert first["reports"] == second["reports"]
    assert first["routes"] == second["routes"]
    torch.testing.assert_close(first["params"], second["params"], rtol=0, atol=0)
    decided = [r["decided_at_step"] for r in first["reports"]]
    # Decided after the warm-up; then, after its trials (the decision's if it changed
    # paths, a challenger's if it did not or its trial fell), every EVERY steps.
    trials = 0
    while first["reports"][WARMUP - 1 + trials * TRIAL_STEPS]["judging"]:
        trials += 1
    assert trials <= 2
    second_decision = WARMUP + trials * TRIAL_STEPS + EVERY
    assert decided == [None] * (WARMUP - 1) + [WARMUP] * (second_decision - WARMUP) + [
        second_decision
    ] * (STEPS + 1 - second_decision)
    if trials:
        judged = first["reports"][WARMUP + trials * TRIAL_STEPS - 1]
        assert not judged["judging"]
        assert set(judged["challenge"] or judged["trial"]) == {
            "replaced_seconds",
            "seconds",
            "kept",
        }
    report = first["reports"][-1]
    assert set(report["predicted_seconds"]) == {"chosen", "codec", "fp16", "fp32"}
    assert (
        report["predicted_seconds"]["chosen"]
        <= min(report["predicted_seconds"][p] for p in ("codec", "fp16", "fp32")) + 1e-12
    )


def test_pinned_tensor_keeps_its_codec(adaptive_runs):
    for routes in adaptive_runs[0]["routes"]:
        assert routes["middle.weight"] != "allreduce (uncompressed)"
        assert routes["middle.weight"] != "allreduce (fp16)"
    assert adaptive_runs[0]["reports"][-1]["paths"]["middle.weight"] == "codec"


def test_a_late_rank_delays_the_probe_but_is_not_measured_as_the_link(adaptive_runs):
    report = adaptive_runs[0]["reports"][WARMUP - 1]
    assert report["decided_at_step"] == WARMUP
    assert set(report["links"]) == {"fp32", "fp16", "bytes"}
    assert all(link["latency_seconds"] < LATE_SECONDS / 10 for link in report["links"].values())


def test_leaving_the_codec_delivers_every_residual():
    """Sum over steps of the exchanged averages equals the sum of the averaged local
    gradients once the tensor went to fp32: its worker and server residuals travelled with
    its first allreduce, and nothing of them is kept after."""
    results = run_parallel(_leave_codec_runs, 2, timeout=240)
    for exchange in ("allgather", "sharded"):
        first, second = (result[exchange] for result in results)
        steps = len(first["exchanged"])
        for step in range(steps):
            torch.testing.assert_close(
                first["exchanged"][step], second["exchanged"][step], rtol=0, atol=0
            )
        true_sum = sum((a + b) / 2 for a, b in zip(first["local"], second["local"]))
        sent_sum = sum(first["exchanged"])
        before_switch = sum((a + b) / 2 for a, b in zip(first["local"][:3], second["local"][:3]))
        # Before the switch the codec held something back; after it, nothing.
        assert not torch.allclose(sum(first["exchanged"][:3]), before_switch, atol=1e-5), exchange
        torch.testing.assert_close(sent_sum, true_sum, rtol=1e-5, atol=1e-6)
        assert "hidden.weight" in first["residuals"][2], exchange
        assert "hidden.weight" not in first["residuals"][3], exchange
        assert "hidden.weight" not in first["residuals"][4], exchange
