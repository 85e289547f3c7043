"""PowerSGD: the PyTorch port against torch's own ``powerSGD_hook`` and the numpy
reference in real Horovod jobs, its state resumed bitwise, and its checks."""

import io
import socket

import numpy as np
import pytest
import torch

import hvd_compress

from .devices import DEVICES, rank_device
from .harness import run_parallel
from .powersgd_reference import (
    RANK,
    SHAPES,
    START_ITER,
    STEPS,
    gradient,
    matrix,
    reference_averages,
)


class _Gradients(torch.nn.Module):
    """Parameters of ``SHAPES`` whose gradients are what ``forward`` is given."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(s)) for s in SHAPES.values()
        )

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.weights, grads))


def _step(pipeline, params, grads):
    """One exchange of ``grads`` through ``pipeline``; the averaged gradients."""
    for p, g in zip(params, grads):
        p.grad = g.clone()
        pipeline.launch(p)
    pipeline.synchronize([])
    return [p.grad.clone() for p in params]


def _against_the_hook(device_kind, port):
    """Steps of our pipeline and of DDP with ``powerSGD_hook`` (one bucket per tensor, the
    hook's first Q taken from ours) on the same gradients; then a resume."""
    import horovod.torch as hvd
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    import hvd_compress.pt as hc
    from hvd_compress.pt.pipeline import CompressionPipeline

    hvd.init()
    device = rank_device(device_kind)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=hvd.rank(),
        world_size=hvd.size(),
    )
    ours, theirs = _Gradients().to(device), _Gradients().to(device)
    codec = hc.PowerSGD(rank=RANK, start_iter=START_ITER)
    pipeline = CompressionPipeline(list(ours.named_parameters()), codec, error_feedback=True)
    # bucket_cap_mb that rounds to one byte: every parameter in a bucket of its own.
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=1e-6)
    state = hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=RANK,
        start_powerSGD_iter=START_ITER,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
    )
    our_names = [name for name, _ in ours.named_parameters()]
    name_of = {p: name for p, name in zip(theirs.parameters(), our_names)}

    def hook_from_our_start(state, bucket):
        # DDP rebuilds its buckets after the first step, one per tensor from then on.
        if state.iter >= START_ITER and bucket.index() not in state.q_memory_dict:
            [param] = bucket.parameters()
            factor = pipeline.state.factors.residuals.get(name_of[param])
            if factor is not None:
                # Warm start from our Q: the hook orthogonalizes it, as we do.
                state.q_memory_dict[bucket.index()] = factor.clone().view(-1)
                state.p_memory_dict[bucket.index()] = torch.empty_like(factor.view(-1))
        # Finished before the next bucket's: Gloo matches collectives by the order each
        # rank submits them, and the hook submits its Q allreduce from a callback
        # (``benchmarks.methods``).
        future = hook.powerSGD_hook(state, bucket)
        future.wait()
        return future

    ddp.register_comm_hook(state, hook_from_our_start)
    steps, counted = [], []
    for step in range(STEPS):
        grads = [
            torch.from_numpy(gradient(step, hvd.rank(), i, s, matrix(codec, s))).to(device)
            for i, s in enumerate(SHAPES.values())
        ]
        theirs.zero_grad(set_to_none=True)
        ddp(grads).backward()
        mine = _step(pipeline, list(ours.parameters()), grads)
        counted.append((pipeline.last_step_bytes, pipeline.expected_bytes()))
        steps.append(([g.cpu() for g in mine], [p.grad.cpu() for p in theirs.parameters()]))

    # Resume: the same three steps from a checkpoint of the state, in a new pipeline.
    saved = io.BytesIO()
    torch.save(pipeline.state_dict(), saved)
    later = [
        [
            torch.from_numpy(gradient(STEPS + k, hvd.rank(), i, s, matrix(codec, s))).to(device)
            for i, s in enumerate(SHAPES.values())
        ]
        for k in range(3)
    ]
    straight = [_step(pipeline, list(ours.parameters()), g) for g in later]
    resumed = CompressionPipeline(list(ours.named_parameters()), codec, error_feedback=True)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    again = [_step(resumed, list(ours.parameters()), g) for g in later]
    resumed_bitwise = all(torch.equal(a, b) for x, y in zip(straight, again) for a, b in zip(x, y))
    dist.destroy_process_group()
    return steps, resumed_bitwise, resumed.compression_stats(), counted


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_powersgd_hook_and_the_reference(device):
    ranks = run_parallel(_against_the_hook, 2, device, _free_port())
    steps, resumed_bitwise, stats, counted = ranks[0]
    # The bytes handed to Horovod, as the cost model counts them, every step.
    assert all(handed == expected for handed, expected in counted)
    reference = list(
        reference_averages(hvd_compress.PowerSGD(RANK, start_iter=START_ITER), SHAPES, STEPS, 2)
    )
    for (mine, _), (others, _) in zip(steps, ranks[1][0]):
        for a, b in zip(mine, others):
            assert torch.equal(a, b)  # every rank holds the same average
    for step, ((mine, hooks), want) in enumerate(zip(steps, reference)):
        for name, a, b in zip(SHAPES, mine, hooks):
            if step < START_ITER:
                assert torch.equal(a, b), (step, name)  # both a plain allreduce
            # The same float32 operations, some in another order (mm against bmm, Horovod's
            # and Gloo's sums, the hook's error feedback on whole tensors): differences of
            # a few units in the last place of the largest value, 2^-23 = 1.2e-7 of it,
            # which the error feedback carries into later steps without growing them.
            # The float64 reference is within the same distance of both.
            for other in (b.numpy(), want[name]):
                assert np.abs(a.numpy() - other).max() <= 2e-6 * np.abs(other).max(), (step, name)
    assert resumed_bitwise
    reasons = [(route, reason) for _, _, route, reason in stats["tensors"]]
    assert reasons == [
        ("allreduce", "compressed"),
        ("allreduce", "compressed"),
        ("allreduce (uncompressed)", "rank 1 saves < 2x"),
        ("allreduce (uncompressed)", "rank 2 saves < 2x"),
        ("allreduce", "compressed"),
    ]
    # P and Q of rank 2: (n + m) 2 float32 values per compressed tensor, the others whole.
    assert stats["bytes_handed"] == 4 * 2 * ((6 + 27) + (10 + 24) + (16 + 16)) + 4 * (10 + 80)


@pytest.mark.parametrize("device", DEVICES)
def test_orthogonalize_keeps_zero_columns_zero(device):
    import hvd_compress.pt as hc

    matrix = torch.randn(7, 3, generator=torch.Generator().manual_seed(0)).to(device)
    matrix[:, 1] = 0
    q = hc.PowerSGD.orthogonalize(matrix)
    assert torch.isfinite(q).all() and not q[:, 1].any()
    torch.testing.assert_close(q.T @ q, torch.diag(torch.tensor([1.0, 0.0, 1.0], device=device)))
    assert not hc.PowerSGD.orthogonalize(torch.zeros(5, 2, device=device)).any()


def test_bad_input_names_the_parameter():
    import hvd_compress.pt as hc

    with pytest.raises(ValueError, match="rank must be >= 1"):
        hc.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="min_compression_rate must be >= 1"):
        hc.PowerSGD(min_compression_rate=0.5)
    with pytest.raises(ValueError, match="start_iter must be >= 0"):
        hc.PowerSGD(start_iter=-1)
    with pytest.raises(ValueError, match="0-d tensor"):
        hc.PowerSGD().matrix_shape(())
    with pytest.raises(ValueError, match="rank must be >= 1"):
        hvd_compress.registry.resolve("powersgd:rank=0", hc.CODECS)
    assert hc.PowerSGD().why_whole(()) == "a scalar"
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        hc.PowerSGD().compress(torch.zeros(4, 4))
