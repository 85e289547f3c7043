"""The adaptive mode in real Horovod jobs, of both ports: the same decisions on every rank,
pins, a late rank at the probe, and error feedback kept whole when a tensor leaves its
codec. Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``)."""

import contextlib
import itertools

import numpy as np
import pytest
import torch

from hvd_compress.trial import TRIAL_STEPS

from .devices import DEVICES, rank_device
from .harness import run_parallel
from .pt_jobs import Net, random_batch

pytestmark = pytest.mark.multiprocess

# Step 2 ends in a decision (warm-up of 2); each trial that follows (the decision's, if it
# changed paths; a challenger's, if it did not or its trial fell) takes TRIAL_STEPS (the
# least trial, trial_seconds=0), and EVERY = 3 steps after the last the next decision
# comes, by step 45.
WARMUP, EVERY = 2, 3
STEPS = WARMUP + 2 * TRIAL_STEPS + EVERY
LATE_SECONDS = 1.5
# A tensor that leaves its codec: for fp32 after SWITCH_AT of SWITCH_STEPS steps.
SWITCH_AT, SWITCH_STEPS = 3, 5
# The tensor each run pins to its codec (the middle layer's weights, 1,920 elements).
PINNED = {"torch": "middle.weight", "tensorflow": "middle/kernel:0"}


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
        adaptive=_options("torch"),
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
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
    }


def _options(framework):
    import hvd_compress

    return hvd_compress.Adaptive(
        warmup_steps=WARMUP, every=EVERY, pin={PINNED[framework]: "codec"}, trial_seconds=0
    )


def _tf_adaptive_run():
    """``_adaptive_run`` with the TensorFlow tape in a traced step: rank 1 arrives late at
    the step that ends in the first decision."""
    import time

    import horovod.tensorflow as hvd

    import hvd_compress.tf as htf

    from .tf_perceptron import tape_steps

    hvd.init()
    reports, routes = [], []
    steps = tape_steps(
        STEPS,
        True,
        compression=htf.TernGrad(min_size=1000, compress_classifier=False),
        adaptive=_options("tensorflow"),
    )
    for step, taken in enumerate(steps):
        *_, variables, pipeline = taken
        stats = pipeline.compression_stats()
        reports.append(stats["adaptive"])
        routes.append({name: route for name, _, route, _ in stats["tensors"]})
        if step == WARMUP - 2 and hvd.rank() == 1:
            time.sleep(LATE_SECONDS)
    return {
        "reports": reports,
        "routes": routes,
        "params": np.concatenate([v.numpy().reshape(-1) for v in variables]),
    }


def _leave_codec(codec, exchange):
    """ef-sign (worker and server residuals) whose large tensor leaves the codec for fp32
    after ``SWITCH_AT`` steps, as a decision would send it; returns every step's local
    gradients and exchanged averages of that tensor, and whether it kept residuals."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = []
    model.hidden.weight.register_post_accumulate_grad_hook(
        lambda p: local.append(p.grad.detach().numpy().copy())
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
    exchanged, kept = [], []
    for step in range(SWITCH_STEPS):
        if step == SWITCH_AT:
            pipeline.state.planner.paths["hidden.weight"] = "fp32"
            pipeline.follow_paths()
        optimizer.zero_grad()
        x, y = random_batch(data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.synchronize()
        exchanged.append(model.hidden.weight.grad.detach().numpy().copy())
        kept.append(
            any(
                "hidden.weight" in memory.residuals
                for memory in (pipeline.state.worker, pipeline.state.server)
            )
        )
        with optimizer.skip_synchronize():
            optimizer.step()
    return {"local": local, "exchanged": exchanged, "kept": kept}


def _leave_codec_runs():
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    return {
        exchange: _leave_codec(hc.BlockSign(min_size=1000), exchange)
        for exchange in ("allgather", "sharded")
    }


def _tf_leave_codec_runs():
    """``_leave_codec_runs`` with the TensorFlow tape in a traced step, whose path the
    variable it reads changes without tracing it again."""
    import horovod.tensorflow as hvd

    import hvd_compress
    import hvd_compress.tf as htf

    from .tf_perceptron import tape_steps

    hvd.init()
    runs = {}
    for exchange in ("allgather", "sharded"):
        steps = tape_steps(
            SWITCH_STEPS,
            True,
            compression=htf.BlockSign(min_size=1000),
            exchange=exchange,
            adaptive=hvd_compress.Adaptive(warmup_steps=100),
        )
        local, exchanged, kept = [], [], []
        for step, (grads, averages, _, pipeline) in enumerate(steps):
            local.append(grads[0].numpy())
            exchanged.append(averages[0].numpy())
            name = pipeline.plans[0].name
            kept.append(
                any(
                    np.any(memory.residuals[name].numpy())
                    for memory in (pipeline.state.worker, pipeline.state.server)
                )
            )
            if step == SWITCH_AT - 1:
                pipeline.state.planner.paths[name] = "fp32"
                pipeline.follow_paths()
        runs[exchange] = {"local": local, "exchanged": exchanged, "kept": kept}
    return runs


@contextlib.contextmanager
def _counting_alltoalls(fusion_class):
    """Yields a list into whose last item ``fusion_class`` (a port's ``AlltoallFusion``)
    counts the alltoalls it starts inside the block."""
    started = [0]
    launch = fusion_class._alltoall

    def counted(self, rows):
        started[-1] += 1
        return launch(self, rows)

    fusion_class._alltoall = counted
    try:
        yield started
    finally:
        fusion_class._alltoall = launch


def _group_runs():
    """ef-sign's sharded exchange of every tensor (``min_size=0``: six tensors, one fusion
    group), by the codec alone and in the adaptive mode (a warm-up of 100: no decision)
    whose first tensor leaves the codec for fp32 at step ``SWITCH_AT``: every step's
    exchanged gradients and the alltoalls it started."""
    import hvd_compress.pt as hc
    from hvd_compress.pt.fusion import AlltoallFusion

    with _counting_alltoalls(AlltoallFusion) as started:
        return {
            "codec": _pt_group_run(None, started),
            "adaptive": _pt_group_run(hc.Adaptive(warmup_steps=100, pin={}), started),
        }


def _pt_group_run(adaptive, started):
    """One run of ``_group_runs``: (exchanged gradients, alltoalls) of every step."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        compression=hc.BlockSign(min_size=0),
        exchange="sharded",
        adaptive=adaptive,
    )
    pipeline = optimizer._hvdc_pipeline
    data = torch.Generator().manual_seed(300 + hvd.rank())
    exchanged, alltoalls = [], []
    for step in range(SWITCH_AT + 1):
        if adaptive is not None and step == SWITCH_AT:
            pipeline.state.planner.paths["hidden.weight"] = "fp32"
            pipeline.follow_paths()
        optimizer.zero_grad()
        started.append(0)
        x, y = random_batch(data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.synchronize()
        exchanged.append([p.grad.detach().numpy().copy() for p in model.parameters()])
        alltoalls.append(started[-1])
        with optimizer.skip_synchronize():
            optimizer.step()
    return exchanged, alltoalls


def _tf_group_runs():
    """``_group_runs`` with the TensorFlow tape: the exchanged gradients of traced steps,
    whose graph holds the group's every path, and the alltoalls of eager steps, which start
    those of the path taken alone."""
    import horovod.tensorflow as hvd

    import hvd_compress
    import hvd_compress.tf as htf
    from hvd_compress.tf.fusion import AlltoallFusion

    from .tf_perceptron import tape_steps

    hvd.init()
    runs = {}
    with _counting_alltoalls(AlltoallFusion) as started:
        for adaptive, traced in itertools.product((False, True), (True, False)):
            steps = tape_steps(
                SWITCH_AT + 1,
                traced,
                compression=htf.BlockSign(min_size=0),
                exchange="sharded",
                adaptive=hvd_compress.Adaptive(warmup_steps=100, pin={}) if adaptive else None,
            )
            exchanged, alltoalls = [], []
            for step in range(SWITCH_AT + 1):
                started.append(0)
                _, averages, _, pipeline = next(steps)
                exchanged.append([a.numpy() for a in averages])
                alltoalls.append(started[-1])
                if adaptive and step == SWITCH_AT - 1:
                    pipeline.state.planner.paths[pipeline.plans[0].name] = "fp32"
                    pipeline.follow_paths()
            runs["adaptive" if adaptive else "codec", traced] = (exchanged, alltoalls)
    return {path: (runs[path, True][0], runs[path, False][1]) for path in ("codec", "adaptive")}


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


def _torch_job():
    """Every PyTorch run of the tests below, in one Horovod job."""
    return {"decisions": _adaptive_run(), "leave": _leave_codec_runs(), "group": _group_runs()}


def _tf_job():
    """Every TensorFlow run of the tests below, in one Horovod job, on one inter-op thread
    (as the benchmark's workers run), which the step's end holds while it decides."""
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    return {
        "decisions": _tf_adaptive_run(),
        "leave": _tf_leave_codec_runs(),
        "group": _tf_group_runs(),
    }


@pytest.fixture(scope="module", params=["torch", "tensorflow"])
def runs(request):
    # A shared job holds one framework's Horovod: the TensorFlow bodies take their own.
    tensorflow = request.param == "tensorflow"
    job = _tf_job if tensorflow else _torch_job
    return request.param, run_parallel(job, 2, timeout=360, own_job=tensorflow)


@pytest.fixture
def adaptive_runs(runs):
    framework, results = runs
    return framework, [result["decisions"] for result in results]


def test_every_rank_takes_the_same_decisions(adaptive_runs):
    _, (first, second) = adaptive_runs
    assert first["reports"] == second["reports"]
    assert first["routes"] == second["routes"]
    np.testing.assert_array_equal(first["params"], second["params"])
    reports = first["reports"]  # reports[i]: after step i + 1
    decided = [r["decided_at_step"] for r in reports]
    # Decided after the warm-up; then, after the trials of each decision (the decision's if
    # it changed paths, a challenger's if it did not or its trial fell), EVERY steps later.
    expected, decision, first_trials = [None] * (WARMUP - 1), WARMUP, None
    while len(expected) < len(reports):
        trials = 0
        while (
            decision - 1 + trials * TRIAL_STEPS < len(reports)
            and reports[decision - 1 + trials * TRIAL_STEPS]["judging"]
        ):
            trials += 1
        assert trials <= 2
        first_trials = trials if first_trials is None else first_trials
        following = decision + trials * TRIAL_STEPS + EVERY
        expected += [decision] * (following - decision)
        decision = following
    assert decided == expected[: len(reports)]
    if first_trials:
        judged = reports[WARMUP + first_trials * TRIAL_STEPS - 1]
        assert not judged["judging"]
        assert set(judged["challenge"] or judged["trial"]) == {
            "replaced_seconds",
            "seconds",
            "turns",
            "kept",
        }
    report = first["reports"][-1]
    assert set(report["predicted_seconds"]) == {"chosen", "codec", "fp16", "fp32"}
    assert (
        report["predicted_seconds"]["chosen"]
        <= min(report["predicted_seconds"][p] for p in ("codec", "fp16", "fp32")) + 1e-12
    )


def test_pinned_tensor_keeps_its_codec(adaptive_runs):
    framework, (first, _) = adaptive_runs
    pinned = PINNED[framework]
    for routes in first["routes"]:
        assert routes[pinned] != "allreduce (uncompressed)"
        assert routes[pinned] != "allreduce (fp16)"
    assert first["reports"][-1]["paths"][pinned] == "codec"


def test_a_late_rank_delays_the_probe_but_is_not_measured_as_the_link(adaptive_runs):
    report = adaptive_runs[1][0]["reports"][WARMUP - 1]
    assert report["decided_at_step"] == WARMUP
    assert set(report["links"]) == {"fp32", "fp16", "bytes"}
    assert all(link["latency_seconds"] < LATE_SECONDS / 10 for link in report["links"].values())


def test_leaving_the_codec_delivers_every_residual(runs):
    """Sum over steps of the exchanged averages equals the sum of the averaged local
    gradients once the tensor went to fp32: its worker and server residuals travelled with
    its first allreduce, and nothing of them is kept after."""
    for exchange in ("allgather", "sharded"):
        first, second = (result["leave"][exchange] for result in runs[1])
        for mine, theirs in zip(first["exchanged"], second["exchanged"]):
            np.testing.assert_array_equal(mine, theirs)
        averaged = [(a + b) / 2 for a, b in zip(first["local"], second["local"])]
        # Before the switch the codec held something back; after it, nothing.
        held_back = sum(first["exchanged"][:SWITCH_AT]) - sum(averaged[:SWITCH_AT])
        assert np.abs(held_back).max() > 1e-5, exchange
        np.testing.assert_allclose(
            sum(first["exchanged"]), sum(averaged), rtol=1e-5, atol=1e-6, err_msg=exchange
        )
        switched = SWITCH_STEPS - SWITCH_AT
        assert first["kept"] == [True] * SWITCH_AT + [False] * switched, exchange


def test_a_fusion_group_travels_in_one_alltoall_until_a_member_leaves_its_codec(runs):
    """While every tensor of a fusion group is on its codec the adaptive mode exchanges them
    as the codec alone does, bit for bit and in the group's one alltoall; when one leaves
    for fp32, the others go on by their codec: in PyTorch in a group of the five, in a
    traced TensorFlow step (whose paths are chosen as it runs) each in an alltoall of its
    own."""
    framework, results = runs
    after = 1 if framework == "torch" else 5
    for result in results:
        (codec, codec_alltoalls), (adaptive, alltoalls) = (
            result["group"]["codec"],
            result["group"]["adaptive"],
        )
        assert codec_alltoalls == [1] * (SWITCH_AT + 1)
        assert alltoalls == [1] * SWITCH_AT + [after]
        for step in range(SWITCH_AT):
            for got, want in zip(adaptive[step], codec[step]):
                np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        (left, *others), (codec_left, *codec_others) = adaptive[SWITCH_AT], codec[SWITCH_AT]
        for got, want in zip(others, codec_others):
            np.testing.assert_array_equal(got, want)
        assert not np.array_equal(left, codec_left)
