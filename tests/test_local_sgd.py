"""CELGC local SGD with per-worker gradient clipping (``LocalClipSGD``) in real Horovod jobs."""

import collections
import contextlib
import copy

import pytest
import torch

from .harness import run_parallel
from .pt_jobs import Net, flat, random_batch

pytestmark = pytest.mark.multiprocess

# On Net's random batches ||g|| is 0.6 to 1.3, so with gamma / eta = 0.1 every step is
# clipped and moves the weights by exactly gamma.
LR, CLIP = 0.5, 0.05
STEPS = 13


class NormNet(torch.nn.Module):
    """A BatchNorm layer, for its running statistics (floating-point buffers) and its batch
    counter (an integer buffer)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))


def _batch(rank, step):
    data = torch.Generator().manual_seed(1000 * step + rank)
    return random_batch(data)


@contextlib.contextmanager
def _counting_calls(hvd):
    """Counts the calls of Horovod's grouped allreduces by the name they are given."""
    calls = collections.Counter()
    originals = {
        name: getattr(hvd, name) for name in ("grouped_allreduce_async", "grouped_allreduce_async_")
    }

    def counted(real):
        def call(tensors, **kwargs):
            calls[kwargs.get("name")] += 1
            return real(tensors, **kwargs)

        return call

    for name, real in originals.items():
        setattr(hvd, name, counted(real))
    try:
        yield calls
    finally:
        for name, real in originals.items():
            setattr(hvd, name, real)


def _train(sync_every, clipping, compression, steps=STEPS, model_class=Net, **options):
    """Local clipped SGD on this rank's batches; records the parameters before each step,
    after its local update (a step post-hook of the wrapped SGD fires there, before any
    averaging round) and after the step, and the worker residuals after each step."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(hvd.rank())  # different on every rank until the broadcast
    model = model_class()
    optimizer = hc.LocalClipSGD(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        clip=CLIP,
        sync_every=sync_every,
        clipping=clipping,
        compression=compression,
        **options,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    local = []
    optimizer.register_step_post_hook(lambda *_: local.append(flat(model)))
    records = []
    with _counting_calls(hvd) as calls:
        for step in range(steps):
            before = flat(model)
            optimizer.zero_grad()
            x, y = _batch(hvd.rank(), step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state = optimizer.state_dict()["hvd_compress"]
            records.append(
                {
                    "before": before,
                    "local": local[-1],
                    "after": flat(model),
                    "bytes": optimizer.last_step_bytes,
                    "residuals": state.get("pipeline", {}).get("worker", {}),
                    "buffers": {n: b.clone() for n, b in model.named_buffers()},
                }
            )
    stats = optimizer.compression_stats()
    return {
        "records": records,
        "syncs": optimizer.syncs,
        "counts": dict(calls),
        "local_steps": optimizer.local_steps,
        "tensors": stats["tensors"],
        "uncompressed": stats["bytes_uncompressed"],
        "names": [(n, p.numel()) for n, p in model.named_parameters()],
    }


UNCOMPRESSED = [
    (4, "local", "none"),
    (4, "max", "none"),
    (3, "global_average", "none"),
    (1, "local", "none"),
]
COMPRESSED = [
    (2, "local", {"name": "terngrad", "min_size": 100}),
    (2, "local", {"name": "ef-sign", "min_size": 100}),
]


def _train_many(configs):
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    results = []
    for sync_every, clipping, compression in configs:
        if isinstance(compression, dict):
            params = dict(compression)
            compression = hc.CODECS[params.pop("name")](**params)
        results.append(_train(sync_every, clipping, compression))
    results.append(_train(2, "local", "none", model_class=NormNet))
    results.append(_train(2, "local", "none", model_class=NormNet, average_buffers=False))
    return results


def _norm(x):
    return float(torch.linalg.vector_norm(x.double()))


def _check_rounds(results, sync_every):
    """Bitwise-equal parameters on every rank after every round, different ones between."""
    for step in range(len(results[0]["records"])):
        after = [r["records"][step]["after"] for r in results]
        if (step + 1) % sync_every == 0:
            assert all(torch.equal(a, after[0]) for a in after[1:]), f"ranks differ at {step}"
        elif len(results) > 1:
            assert not torch.equal(after[0], after[1]), f"step {step} was not local"


@pytest.mark.parametrize("world", [2, 4])
def test_rounds_agree_steps_are_clipped_and_collectives_counted(world):
    per_rank = run_parallel(_train_many, world, UNCOMPRESSED + COMPRESSED, timeout=600)
    runs = [list(results) for results in zip(*per_rank)]
    whole = runs[0][0]["uncompressed"]  # bytes of all parameters
    for (sync_every, clipping, compression), results in zip(UNCOMPRESSED + COMPRESSED, runs):
        _check_rounds(results, sync_every)
        for r in results:
            assert r["local_steps"] == STEPS
            assert r["syncs"] == STEPS // sync_every
            # "global_average" and "max" average the gradients at the first step after each
            # round (and at step 0), one more grouped allreduce of all parameters' size.
            gradient_rounds = 0 if clipping == "local" else -(-STEPS // sync_every)
            assert r["counts"].get("hvdc.local_sgd.gradients", 0) == gradient_rounds
            if compression == "none":
                assert r["counts"]["hvdc.local_sgd.parameters"] == STEPS // sync_every
            for step, record in enumerate(r["records"]):
                averages_gradients = clipping != "local" and step % sync_every == 0
                is_round = (step + 1) % sync_every == 0
                if compression == "none":
                    assert record["bytes"] == whole * (averages_gradients + is_round)
                elif is_round:  # compressed rounds hand fewer bytes than whole parameters
                    assert 0 < record["bytes"] < whole / 3
                else:
                    assert record["bytes"] == 0
            if clipping == "global_average":
                continue  # its step is gamma / ||g_bar|| times ||g_i||, which may exceed gamma
            last_round = r["records"][0]["before"]
            for step, record in enumerate(r["records"]):
                # A local step moves the weights by at most gamma; with "local" clipping and
                # every gradient above gamma / eta, by exactly gamma.
                move = _norm(record["local"] - record["before"])
                assert move <= CLIP * (1 + 1e-5)
                if clipping == "local":
                    assert move == pytest.approx(CLIP, rel=1e-5)
                # Drift from the last round: at most gamma per local step since (Lemma 1).
                since = step % sync_every + 1
                assert _norm(record["local"] - last_round) <= CLIP * since * (1 + 1e-5)
                if (step + 1) % sync_every == 0:
                    last_round = record["after"]
    _check_error_feedback(runs[len(UNCOMPRESSED)], COMPRESSED[0][0])

    # BatchNorm running statistics are averaged at rounds unless average_buffers=False.
    for results, averaged in ((runs[-2], True), (runs[-1], False)):
        buffers = [r["records"][1]["buffers"] for r in results]
        assert torch.equal(
            buffers[0]["norm.num_batches_tracked"], buffers[1]["norm.num_batches_tracked"]
        )
        assert (
            torch.equal(buffers[0]["norm.running_mean"], buffers[1]["norm.running_mean"])
            == averaged
        )


def _check_error_feedback(results, sync_every):
    """Nothing is lost by a compressed round (TernGrad, error feedback on the moves):
    x_after + mean_i e_i = mean_i x_i + mean_i e_i,previous, where x_i is worker i's
    parameters after its local update and e_i its residual."""
    world = len(results)
    names = results[0]["names"]
    compressed = {name for name, _, _, reason in results[0]["tensors"] if reason == "compressed"}
    assert {"hidden.weight", "middle.weight"} <= compressed

    def mean_residual(step):
        if step < 0:
            return 0
        return torch.cat(
            [
                sum(
                    r["records"][step]["residuals"]
                    .get(name, torch.zeros(numel))
                    .reshape(-1)
                    .double()
                    for r in results
                )
                / world
                for name, numel in names
            ]
        )

    previous = -1
    for step in range(sync_every - 1, STEPS, sync_every):
        moved = sum(r["records"][step]["local"].double() for r in results) / world
        after = results[0]["records"][step]["after"].double()
        torch.testing.assert_close(
            after + mean_residual(step), moved + mean_residual(previous), rtol=0, atol=1e-6
        )
        previous = step


def _against_clipped_sgd(steps=12, lr=0.1, clip=0.085):
    """One worker, a round after every step: LocalClipSGD against torch.optim.SGD with the
    step size min(eta_t, gamma_t / ||g||), gamma_t = gamma eta_t / eta_0, written out,
    under momentum, weight decay and a learning-rate decay."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    settings = dict(lr=lr, momentum=0.9, weight_decay=1e-3)
    results = {}
    for clipping in ("local", "global_average", "max"):
        torch.manual_seed(0)
        ours, theirs = Net(), Net()
        theirs.load_state_dict(ours.state_dict())
        opt_ours = hc.LocalClipSGD(
            torch.optim.SGD(ours.parameters(), **settings),
            ours,
            clip=clip,
            sync_every=1,
            clipping=clipping,
        )
        opt_theirs = torch.optim.SGD(theirs.parameters(), **settings)
        schedules = [
            torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5)
            for o in (opt_ours, opt_theirs)
        ]
        clipped = []
        for step in range(steps):
            x, y = _batch(0, step)
            for model, optimizer in ((ours, opt_ours), (theirs, opt_theirs)):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
            eta = opt_theirs.param_groups[0]["lr"]
            norm = float(
                torch.linalg.vector_norm(
                    torch.cat([p.grad.reshape(-1) for p in theirs.parameters()])
                )
            )
            opt_theirs.param_groups[0]["lr"] = min(eta, clip * eta / lr / norm)
            clipped.append(opt_theirs.param_groups[0]["lr"] < eta)
            opt_theirs.step()
            opt_theirs.param_groups[0]["lr"] = eta
            opt_ours.step()
            for schedule in schedules:
                schedule.step()
        results[clipping] = (flat(ours), flat(theirs), clipped)
    return results


def test_one_worker_with_a_round_every_step_is_clipped_sgd():
    (results,) = run_parallel(_against_clipped_sgd, 1)
    for clipping, (ours, theirs, clipped) in results.items():
        assert any(clipped) and not all(clipped)  # both branches of the min were taken
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=clipping)


def _resume(split, steps=10, compression="none"):
    """Trains ``steps`` steps straight, and again with a checkpoint after ``split`` steps
    loaded into a new model and optimizer; returns both final parameters."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()

    def build():
        torch.manual_seed(0)
        model = Net()
        optimizer = hc.LocalClipSGD(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
            model,
            clip=CLIP,
            sync_every=4,
            clipping="max",
            compression=compression,
        )
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)

    def run(model, optimizer, schedule, start, stop):
        for step in range(start, stop):
            optimizer.zero_grad()
            x, y = _batch(hvd.rank(), step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()

    straight = build()
    before = flat(straight[0])
    hvd.broadcast_optimizer_state(straight[1], root_rank=0)
    initialized = (straight[1].local_steps, torch.equal(flat(straight[0]), before))
    run(*straight, 0, steps)
    first = build()
    run(*first, 0, split)
    checkpoint = copy.deepcopy([part.state_dict() for part in first])
    second = build()
    for part, state in zip(second, checkpoint):
        part.load_state_dict(state)
    run(*second, split, steps)
    return {"straight": flat(straight[0]), "resumed": flat(second[0]), "initialized": initialized}


@pytest.mark.parametrize("compression", ["none", "terngrad"])
def test_state_dict_resumes_mid_period_bitwise(compression):
    for r in run_parallel(_resume, 2, 6, compression=compression):
        # hvd.broadcast_optimizer_state initialises the SGD state with a zero local step of
        # the base optimizer only: no step counted, no parameter moved, no collective.
        assert r["initialized"] == (0, True)
        assert torch.equal(r["resumed"], r["straight"])


def test_bad_options_name_the_parameter():
    import hvd_compress.pt as hc

    model = torch.nn.Linear(3, 3)

    def make(optimizer=None, **options):
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
        return hc.LocalClipSGD(optimizer, model, **{"clip": 1.0, **options})

    for clip in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"clip \(gamma\) must be > 0"):
            make(clip=clip)
    with pytest.raises(ValueError, match="clip must be finite"):
        make(clip=float("inf"))
    with pytest.raises(ValueError, match="sync_every must be >= 1, got 0"):
        make(sync_every=0)
    with pytest.raises(TypeError, match="sync_every must be an integer"):
        make(sync_every=2.5)
    with pytest.raises(
        ValueError, match="clipping must be one of 'local', 'global_average', 'max'; got 'global'"
    ):
        make(clipping="global")
    with pytest.raises(ValueError, match="compression must be one of"):
        make(compression="zip")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.SGD"):
        make(torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="learning rate of parameter group 0 must be > 0"):
        make(torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.raises(TypeError, match="model must be the torch.nn.Module"):
        hc.LocalClipSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), clip=1.0)
