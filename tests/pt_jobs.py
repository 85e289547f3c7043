"""PyTorch jobs and checks that several multi-process test modules share: the small
perceptron they train, the training loops each rank runs inside a Horovod job
(``harness.run_parallel``), and the checks of their results against the numpy reference.
They import Horovod when called, in the child processes."""

import numpy as np
import torch

from hvd_compress import seeding, simulate
from hvd_compress.seeding import stream_seed

from . import process_sets
from .devices import rank_device

TERNGRAD = {"min_size": 1000, "compress_classifier": False}


class Net(torch.nn.Module):
    """Weights of 10,240 and 2,000 elements (compressed) and small biases (sent whole)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 160)
        self.middle = torch.nn.Linear(160, 12)
        self.out = torch.nn.Linear(12, 10)

    def forward(self, x):
        return self.out(torch.relu(self.middle(torch.relu(self.hidden(x)))))


def random_batch(data):
    """A batch of ``Net``'s inputs and labels drawn from the generator ``data``."""
    return torch.randn(8, 64, generator=data), torch.randint(0, 10, (8,), generator=data)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def local_gradients(model):
    """{name: this rank's last local gradient}, kept by hooks that run before those of a
    ``DistributedOptimizer`` made afterwards."""
    local = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: local.__setitem__(name, p.grad.detach().clone())
        )
    return local


def train(
    codec,
    exchange,
    steps=3,
    passes=1,
    clip_norm=None,
    nan_at=None,
    op="average",
    error_feedback=None,
    layout=None,
):
    """Trains ``Net`` on random data of this rank (averaged in its process set of
    ``layout``, ``tests.process_sets``); records, each step, the local gradient, the
    exchanged gradient and the parameters."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    process_set = process_sets.join(hvd, layout)
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = {}

    def capture(p, name):
        if (
            nan_at is not None
            and hvd.rank() == 1
            and len(records) == nan_at
            and name == "hidden.weight"
        ):
            p.grad[3, 5] = float("nan")
        local[name] = p.grad.detach().clone()

    records = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: capture(p, name))
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=codec,
        exchange=exchange,
        backward_passes_per_step=passes,
        op=hvd.Average if op == "average" else hvd.Sum,
        error_feedback=error_feedback,
        process_set=process_set,
    )
    data = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(passes):
            x, y = random_batch(data)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.synchronize()
        exchanged = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        with optimizer.skip_synchronize():
            optimizer.step()
        records.append(
            {
                "local": dict(local),
                "exchanged": exchanged,
                "params": flat(model),
                "bytes": optimizer.compression_stats()["bytes_handed"],
            }
        )
    stats = optimizer.compression_stats()
    return {
        "records": records,
        "expected_bytes": optimizer._hvdc_pipeline.expected_bytes(),
        "tensors": stats["tensors"],
        "rank": hvd.rank(),
    }


def _reference(results, codec, step, average=True):
    """The exchanged gradients that the numpy reference computes from every rank's local
    gradients and replayed random draws."""
    world = len(results)
    expected = {}
    for index, (name, _numel, exchange, reason) in enumerate(results[0]["tensors"]):
        grads = [r["records"][step]["local"][name].numpy() for r in results]
        if reason != "compressed":
            total = np.sum(np.stack(grads), axis=0)
            expected[name] = (total / world if average else total, exchange)
            continue
        uniforms = [
            seeding.uniforms(stream_seed(0, rank, step, index), grads[rank].size)
            for rank in range(world)
        ]
        expected[name] = (
            simulate.exchange_step(codec, grads, uniforms, exchange, average),
            exchange,
        )
    return expected


def check_consistent_and_exact(results, codec, average=True):
    for step in range(len(results[0]["records"])):
        first = results[0]["records"][step]
        for other in results[1:]:
            rec = other["records"][step]
            assert torch.equal(rec["params"], first["params"]), f"ranks differ at step {step}"
            for name, grad in rec["exchanged"].items():
                assert torch.equal(grad, first["exchanged"][name])
        for name, (want, exchange) in _reference(results, codec, step, average).items():
            got = first["exchanged"][name].numpy()
            if exchange.startswith("allreduce (") or codec.name == "fp16":
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6, err_msg=name)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9, err_msg=name)
        if codec.wire == "fixed":  # variable-length payloads have no formula
            for r in results:
                assert r["records"][step]["bytes"] == r["expected_bytes"]


def train_side_by_side(pairs, steps, seed):
    """Trains every (model, optimizer) pair on the same batches; returns their parameters."""
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = random_batch(data)
        for model, optimizer in pairs:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return [flat(model) for model, _ in pairs]


def train_ef(
    exchange,
    steps=50,
    drop_at=25,
    codec=None,
    momentum=0.9,
    nesterov=True,
    weight_decay=0.0,
    layout=None,
):
    """Momentum SGD with error feedback on random data (by default dist-EF-blockSGDM with
    every tensor compressed), averaged in this rank's process set of ``layout``
    (``tests.process_sets``); records what the invariant needs."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    process_set = process_sets.join(hvd, layout)
    if codec is None:
        codec = hc.BlockSign(min_size=0)
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    raw = local_gradients(model)
    base = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay
    )
    optimizer = hc.DistributedOptimizer(
        base,
        model.named_parameters(),
        compression=codec,
        exchange=exchange,
        error_feedback=True,
        worker_momentum=True,
        process_set=process_set,
    )
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, [drop_at], gamma=0.1)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    x0, params, grads, rates, handed = flat(model), [], [], [], []
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = random_batch(data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
        grads.append(dict(raw))
        params.append(flat(model))
        handed.append(optimizer.compression_stats()["bytes_handed"])
    state = optimizer.state_dict()["hvd_compress"]
    return {
        "x0": x0,
        "params": params,
        "grads": grads,
        "rates": rates,
        "handed": handed,
        "worker": state.get("worker", {}),
        "server": state.get("server", {}),
        "names": [n for n, _ in model.named_parameters()],
        "numel": {n: p.numel() for n, p in model.named_parameters()},
        "expected": optimizer._hvdc_pipeline.expected_bytes(),
    }


def virtual_iterate_gap(results, exchange, mu=0.9):
    """max relative | x_T - e~_T - mean_i e_T,i - (x_0 - sum_t eta_t mean_i u_t,i) |."""
    world = len(results)
    names, numel = results[0]["names"], results[0]["numel"]
    rates = results[0]["rates"]
    last = rates[-1]
    drift = []
    for r in results:
        momentum = {n: 0 for n in names}
        total = {n: torch.zeros(numel[n], dtype=torch.float64) for n in names}
        for step, grads in enumerate(r["grads"]):
            for n in names:
                g = grads[n].reshape(-1).double()
                momentum[n] = mu * momentum[n] + g
                total[n] += rates[step] * (g + mu * momentum[n])
        drift.append(total)
    gaps = []
    offset = 0
    for n in names:
        size = numel[n]
        x0 = results[0]["x0"][offset : offset + size].double()
        xT = results[0]["params"][-1][offset : offset + size].double()
        # Tensors sent whole, and one-way codecs' servers, keep no residual.
        zero = torch.zeros(size, dtype=torch.float64)
        worker = sum(r["worker"].get(n, zero).double() for r in results) / world
        if exchange == "sharded" and results[0]["server"]:
            server = torch.cat([r["server"][n].double() for r in results])[:size]
        else:
            server = results[0]["server"].get(n, zero).double()
        want = x0 - sum(d[n] for d in drift) / world
        # Residuals are kept in gradient units: eta of the last step turns them into
        # parameter units.
        got = xT - last * (server + worker)
        gaps.append(float((got - want).abs().max() / want.abs().max()))
        offset += size
    return max(gaps)


def adacomp_replay(codec, grads, bin_length):
    """The residue and every step's (G, dW, selection, message, sent) on one worker."""
    residue = np.zeros_like(grads[0])
    steps = []
    for grad in grads:
        compensated = residue + grad
        selected = codec.select(compensated, grad, bin_length)
        message = codec.encode_message(compensated, selected, bin_length)
        sent = codec.decode_message(message, grad.size, bin_length)
        residue = compensated - sent
        steps.append((compensated, grad, selected, message, sent))
    return residue, steps


def train_sparse(codec, steps=6, layout=None):
    """Trains ``Net`` on random data of this rank with a sparse codec, averaged in its
    process set of ``layout`` (``tests.process_sets``); records, each step, the local
    gradients, the exchanged gradients, the parameters and the byte accounting, and at the
    end the worker memory."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    process_set = process_sets.join(hvd, layout)
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: local.__setitem__(name, p.grad.detach().clone())
        )
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=codec,
        process_set=process_set,
    )
    data = torch.Generator().manual_seed(100 + hvd.rank())
    records = []
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = random_batch(data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.synchronize()
        exchanged = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with optimizer.skip_synchronize():
            optimizer.step()
        stats = optimizer.compression_stats()
        records.append(
            {
                "local": dict(local),
                "exchanged": exchanged,
                "params": flat(model),
                "bytes": stats["bytes_handed"],
                "layers": stats["layers"],
                "expected": optimizer._hvdc_pipeline.expected_bytes(),
            }
        )
    return {
        "records": records,
        "tensors": stats["tensors"],
        "kinds": {plan.name: plan.layer for plan in optimizer._hvdc_pipeline.plans.values()},
        "memory": optimizer.state_dict()["hvd_compress"]["worker"],
    }


def assert_sparse_ranks_agree(results, step):
    """Bitwise-equal parameters and exchanged gradients on every rank after ``step``."""
    first = results[0]["records"][step]
    for other in results[1:]:
        rec = other["records"][step]
        assert torch.equal(rec["params"], first["params"]), f"ranks differ at step {step}"
        for name, grad in rec["exchanged"].items():
            assert torch.equal(grad, first["exchanged"][name]), f"{name} at step {step}"


def replay_clt_k(results, codec):
    """Replays CLT-k in numpy from every rank's gradients; returns the leader's indices of
    each step and tensor."""
    world = len(results)
    names = list(results[0]["records"][0]["local"])
    memory = {(rank, n): 0 for rank in range(world) for n in names}
    chosen = []
    for step in range(len(results[0]["records"])):
        leader = step % world
        assert_sparse_ranks_agree(results, step)
        first = results[0]["records"][step]
        indices = {}
        for name in names:
            compensated = [
                memory[rank, name] + r["records"][step]["local"][name].numpy().ravel()
                for rank, r in enumerate(results)
            ]
            k = codec.k(compensated[0].size)
            index = codec.top_k(compensated[leader], k)
            indices[name] = [codec.top_k(p, k) for p in compensated]
            total = np.zeros_like(compensated[0])
            for rank, p in enumerate(compensated):
                sent = np.zeros_like(p)
                sent[index] = p[index]
                total += sent
                memory[rank, name] = (1 - codec.beta) * memory[rank, name] + codec.beta * (p - sent)
            got = first["exchanged"][name].numpy().ravel()
            # The ring allreduce sums in another order than this loop: float32 rounding.
            np.testing.assert_allclose(
                got,
                total / world,
                rtol=1e-5,
                atol=1e-6 * np.abs(total).max(),
                err_msg=f"{name} step {step}",
            )
            # Only the leader's indices carry values.
            assert set(np.flatnonzero(got)) <= set(index.tolist())
        chosen.append(indices)
        for r in results:
            assert r["records"][step]["bytes"] == r["records"][step]["expected"]
    for rank, r in enumerate(results):
        for name in names:
            np.testing.assert_allclose(
                r["memory"][name].numpy().ravel(), memory[rank, name], rtol=1e-5, atol=1e-6
            )
    return chosen


# (label, codec name, codec hyperparameters, error_feedback): every codec, and error feedback
# on a one-way codec.


CHECKPOINT_CASES = [
    ("none", "none", {}, None),
    ("fp16", "fp16", {}, None),
    ("terngrad", "terngrad", {"min_size": 100}, None),
    ("terngrad+ef", "terngrad", {"min_size": 100}, True),
    ("qsgd", "qsgd", {"min_size": 100}, None),
    ("qsgd-inf", "qsgd-inf", {"min_size": 100}, None),
    ("nuqsgd-elias", "nuqsgd", {"min_size": 100, "wire": "elias"}, None),
    ("ef-sign", "ef-sign", {"min_size": 0}, None),
    ("adacomp", "adacomp", {}, None),
    ("clt-k", "clt-k", {}, None),
    ("powersgd", "powersgd", {"start_iter": 1}, None),
]


def setup_case(name, params, error_feedback, exchange="auto", device="cpu"):
    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = Net().to(rank_device(device))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    optimizer = hc.DistributedOptimizer(
        base,
        model.named_parameters(),
        compression=hc.CODECS[name](**params),
        error_feedback=error_feedback,
        seed=3,
        exchange=exchange,
    )
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    return model, optimizer, schedule


def step_case(model, optimizer, schedule, step, rank, scaler=None, poison=False):
    data = torch.Generator().manual_seed(1000 * step + rank)
    device = next(model.parameters()).device
    x, y = (tensor.to(device) for tensor in random_batch(data))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if poison:
        loss = loss * float("nan")
    optimizer.zero_grad()
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
    schedule.step()


def train_and_checkpoint(
    directory, steps, save_at, device, cases=CHECKPOINT_CASES, exchange="auto", layout=None
):
    """Every case trains ``steps`` steps; each rank saves its own checkpoint at ``save_at``
    (worker residuals are per rank). ``layout``: the process sets (``tests.process_sets``)."""
    import horovod.torch as hvd

    process_sets.join(hvd, layout)
    trajectories = {}
    for label, name, params, error_feedback in cases:
        model, optimizer, schedule = setup_case(name, params, error_feedback, exchange, device)
        hvd.broadcast_parameters(model.state_dict(), 0)
        trajectory = []
        for step in range(steps):
            if step == save_at:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(),
                    },
                    f"{directory}/{label}-rank{hvd.rank()}.pt",
                )
            step_case(model, optimizer, schedule, step, hvd.rank())
            trajectory.append(flat(model).cpu())
        trajectories[label] = trajectory
    return trajectories


def resume(directory, steps, save_at, device, cases=CHECKPOINT_CASES, exchange="auto", layout=None):
    """Resumes every case from its checkpoint, loaded the usual way: onto the CPU, whatever
    the device it was saved from (the state must follow the parameters to theirs)."""
    import horovod.torch as hvd

    process_sets.join(hvd, layout)
    trajectories = {}
    for label, name, params, error_feedback in cases:
        model, optimizer, schedule = setup_case(name, params, error_feedback, exchange, device)
        checkpoint = torch.load(
            f"{directory}/{label}-rank{hvd.rank()}.pt", map_location="cpu", weights_only=True
        )
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        schedule.load_state_dict(checkpoint["schedule"])
        trajectory = []
        for step in range(save_at, steps):
            step_case(model, optimizer, schedule, step, hvd.rank())
            trajectory.append(flat(model).cpu())
        trajectories[label] = trajectory
    return trajectories
