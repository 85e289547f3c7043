"""State that survives: checkpoint and resume of every codec's compression state, and steps
with non-finite gradients that leave no trace."""

import pytest
import torch

from .devices import DEVICES
from .harness import run_parallel
from .pt_jobs import (
    CHECKPOINT_CASES,
    Net,
    flat,
    resume,
    setup_case,
    step_case,
    train_and_checkpoint,
)

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("device", DEVICES)
def test_resumed_runs_continue_bitwise_identically(tmp_path, device):
    steps, save_at = 12, 5  # the learning rate halves at steps 4 and 8
    uninterrupted = run_parallel(train_and_checkpoint, 2, str(tmp_path), steps, save_at, device)
    resumed = run_parallel(resume, 2, str(tmp_path), steps, save_at, device, own_job=True)
    for rank in range(2):
        for label, *_ in CHECKPOINT_CASES:
            for offset, params in enumerate(resumed[rank][label]):
                assert torch.equal(params, uninterrupted[rank][label][save_at + offset]), (
                    label,
                    rank,
                    save_at + offset,
                )


def _ef_sign_trained(exchange, steps=3):
    """ef-sign (one block per tensor, every tensor compressed) after ``steps`` steps under
    ``exchange``: (model, optimizer, schedule)."""
    import horovod.torch as hvd

    model, optimizer, schedule = setup_case("ef-sign", {"min_size": 0}, None, exchange)
    hvd.broadcast_parameters(model.state_dict(), 0)
    for step in range(steps):
        step_case(model, optimizer, schedule, step, hvd.rank())
    return model, optimizer, schedule


def _ef_sign_resumed(checkpoint, exchange):
    """ef-sign under ``exchange`` with ``checkpoint``'s model and optimizer state loaded:
    (model, optimizer, schedule)."""
    model, optimizer, schedule = setup_case("ef-sign", {"min_size": 0}, None, exchange)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return model, optimizer, schedule


def _exchange_changes():
    """ef-sign trains 3 steps under one exchange, saves, and resumes under the other, its
    state naming the exchanges that kept its server residuals or not (a state from before
    they were named): [(this rank's residual mass saved, after the resumed pipeline took
    its exchanges, the exchanges it took, the parameters one step later)]."""
    import io

    import horovod.torch as hvd

    from .elastic_train import parameter_mass

    hvd.init()
    results = []
    for saved_with, resumed_with in (("allgather", "sharded"), ("sharded", "allgather")):
        for named in (True, False):
            model, optimizer, _ = _ef_sign_trained(saved_with)
            before = parameter_mass(optimizer._hvdc_pipeline)
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved, weights_only=True)
            if not named:
                del checkpoint["optimizer"]["hvd_compress"]["server_exchanges"]
            model, optimizer, schedule = _ef_sign_resumed(checkpoint, resumed_with)
            pipeline = optimizer._hvdc_pipeline
            pipeline._follow_restored_servers()  # what the next step starts with
            after = parameter_mass(pipeline)
            exchanges = {p.exchange for p in pipeline.plans.values() if p.reason == "compressed"}
            step_case(model, optimizer, schedule, 3, hvd.rank())
            results.append((before, after, exchanges, flat(model)))
    return results


def test_a_state_resumed_under_another_exchange_keeps_its_residual_mass():
    """A server residual is a tensor's on every rank (allgather) or a shard's on one
    (sharded): resumed under the other exchange, it joins the worker residual, and the
    average of the next exchange still carries it."""
    ranks = run_parallel(_exchange_changes, 2)
    for case in range(4):
        (before0, after0, exchanges, params0), (before1, after1, _, params1) = (
            ranks[0][case],
            ranks[1][case],
        )
        assert exchanges == {("sharded", "allgather")[case // 2]}
        for name in before0:
            saved, resumed = before0[name] + before1[name], after0[name] + after1[name]
            assert saved.abs().sum() > 0, name
            torch.testing.assert_close(resumed, saved, rtol=1e-6, atol=1e-7)
        assert torch.equal(params0, params1)


def _save_sharded(directory):
    """ef-sign's sharded exchange among 4 ranks, 3 steps, then each rank's checkpoint and
    the residual mass it holds."""
    import horovod.torch as hvd

    from .elastic_train import parameter_mass

    hvd.init()
    model, optimizer, _ = _ef_sign_trained("sharded")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, f"{directory}/rank{hvd.rank()}.pt")
    return parameter_mass(optimizer._hvdc_pipeline)


def _resume_on_two(directory):
    """Ranks 0 and 1 of the 4 resume under the allgather among 2: the residual mass each
    holds once the pipeline took the new world, and the parameters one step later."""
    import horovod.torch as hvd

    from .elastic_train import parameter_mass

    hvd.init()
    checkpoint = torch.load(f"{directory}/rank{hvd.rank()}.pt", weights_only=True)
    model, optimizer, schedule = _ef_sign_resumed(checkpoint, "allgather")
    pipeline = optimizer._hvdc_pipeline
    pipeline._follow_world()  # what the next step starts with
    after = parameter_mass(pipeline)
    step_case(model, optimizer, schedule, 3, hvd.rank())
    return after, flat(model)


def test_a_state_resumed_in_a_smaller_world_under_another_exchange_keeps_its_mass(tmp_path):
    """Sharded servers' residuals among 4 ranks, resumed by 2 of them under the allgather:
    each rank's shard joins its worker residual at its positions, as when elastic Horovod
    drops ranks, and the ranks that left take theirs with them."""
    saved = run_parallel(_save_sharded, 4, str(tmp_path))
    resumed = run_parallel(_resume_on_two, 2, str(tmp_path), own_job=True)
    for rank in range(2):
        mass, _ = resumed[rank]
        for name, before in saved[rank].items():
            assert before.abs().sum() > 0, name
            torch.testing.assert_close(mass[name], before, rtol=1e-6, atol=1e-7)
    assert torch.equal(resumed[0][1], resumed[1][1])


def _poisoned_step(name, params, error_feedback, exchange, steps, poison_at, kernels):
    """Rank 1's loss is NaN at ``poison_at``; the usual GradScaler loop around our optimizer.
    Without ``kernels`` the CPU runs the eager path, as CUDA tensors do: the step's
    finiteness stays a tensor, and the state commits by selects."""
    import horovod.torch as hvd

    from hvd_compress.pt import fused

    hvd.init()
    enabled, fused.ENABLED = fused.ENABLED, kernels and fused.ENABLED
    try:
        return _poisoned_run(name, params, error_feedback, exchange, steps, poison_at)
    finally:
        fused.ENABLED = enabled


def _poisoned_run(name, params, error_feedback, exchange, steps, poison_at):
    import horovod.torch as hvd

    model, optimizer, schedule = setup_case(name, params, error_feedback, exchange)
    hvd.broadcast_parameters(model.state_dict(), 0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    records = []
    for step in range(steps):
        step_case(
            model,
            optimizer,
            schedule,
            step,
            hvd.rank(),
            scaler,
            poison=step == poison_at and hvd.rank() == 1,
        )
        state = optimizer.state_dict()
        records.append(
            {"params": flat(model), "compression": state["hvd_compress"], "sgd": state["state"]}
        )
    return records


def _flatten(state):
    """Every tensor of a nested state dict, by path."""
    if isinstance(state, torch.Tensor):
        return {"": state}
    if isinstance(state, dict):
        return {
            f"{key}/{path}": tensor
            for key, value in state.items()
            for path, tensor in _flatten(value).items()
        }
    return {}


# With the kernels, ef-sign's servers know their result's finiteness from the server scales
# (``_Exchange.finite``): the replicated one at N = 2 ("auto"), the sharded one. Without
# them (the path of CUDA tensors), every codec's step commits by a flag it never reads.
@pytest.mark.parametrize(
    "label,name,params,error_feedback,exchange,kernels",
    [
        case + ("auto", kernels)
        for case in CHECKPOINT_CASES
        if case[0] in ("terngrad+ef", "ef-sign", "powersgd")
        for kernels in (True, False)
    ]
    + [("ef-sign", "ef-sign", {"min_size": 0}, None, "sharded", True)],
)
def test_nan_on_one_rank_skips_the_step_everywhere_and_leaves_no_trace(
    label, name, params, error_feedback, exchange, kernels
):
    poison_at = 3
    results = run_parallel(
        _poisoned_step, 2, name, params, error_feedback, exchange, 6, poison_at, kernels
    )
    for records in results:
        before, skipped = records[poison_at - 1], records[poison_at]
        assert torch.equal(skipped["params"], before["params"])
        # Residuals (worker and server), worker momentum and SGD buffers are untouched.
        before_state, skipped_state = (
            _flatten(before["compression"]),
            _flatten(skipped["compression"]),
        )
        assert before_state.keys() == skipped_state.keys() and before_state
        for path, tensor in before_state.items():
            assert torch.equal(tensor, skipped_state[path]), path
        for path, tensor in _flatten(before["sgd"]).items():
            assert torch.equal(tensor, _flatten(skipped["sgd"])[path]), path
        # Training goes on, finite and identical on every rank.
        for later in records[poison_at + 1 :]:
            assert torch.isfinite(later["params"]).all()
            assert not torch.equal(later["params"], skipped["params"])
    for a, b in zip(*results):
        assert torch.equal(a["params"], b["params"])


def _mismatched(kind):
    """The optimizer built with a different codec, codec parameter, exchange, model, bucket
    size, adaptive mode or worker momentum on rank 1: the message each rank raises at the
    first step."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    odd = hvd.rank() == 1
    model = torch.nn.Linear(64, 10) if kind == "parameters" and odd else Net()
    codec = {"codec": "qsgd-inf", "hyperparameters": "terngrad:clip=2.0"}.get(kind, "terngrad")
    codec = codec if odd else "terngrad"
    # Gradient buckets of another size would start other collectives.
    options = {
        "bucket_bytes": {"bucket_bytes": 0},
        "exchange": {"exchange": "allgather"},
        "adaptive": {"adaptive": True},
    }
    momentum = 0.9 if kind == "optimizer" and odd else 0.0  # worker momentum for ef-sign
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
        model.named_parameters(),
        compression="ef-sign" if kind == "optimizer" else codec,
        **(options.get(kind, {}) if odd else {}),
    )
    try:  # the ranks compare their configurations before the first exchange
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    except ValueError as error:
        return str(error)
    return None


# What differs on rank 1, and the key of the description that names it.
MISMATCHES = {
    "codec": "codec",
    "hyperparameters": "codec",
    "exchange": "exchange",
    "parameters": "parameters",
    "bucket_bytes": "bucket_bytes",
    "adaptive": "adaptive",
    "optimizer": "optimizer",
}


def _mismatched_everywhere():
    import horovod.torch as hvd

    hvd.init()
    return {kind: _mismatched(kind) for kind in MISMATCHES}


@pytest.fixture(scope="module")
def mismatched():
    return run_parallel(_mismatched_everywhere, 2)


@pytest.mark.parametrize("kind", MISMATCHES)
def test_ranks_with_different_configurations_fail_at_the_first_step_on_every_rank(mismatched, kind):
    messages = [rank[kind] for rank in mismatched]
    for message in messages:
        assert message is not None and "different compression configurations" in message
        assert f"{MISMATCHES[kind]}: rank 0: " in message and "rank 1: " in message
    if kind == "codec":
        assert "TernGrad(" in messages[0] and "QSGDInf(" in messages[0]
    if kind == "hyperparameters":
        assert "clip=2.0" in messages[0]
    if kind == "optimizer":
        assert "'worker_momentum': True" in messages[0], messages[0]
