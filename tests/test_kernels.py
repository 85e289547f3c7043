"""ef-sign's fused CPU kernels (``hvd_compress.kernels`` through ``hvd_compress.pt.fused``)
against the eager codec, memory and server calls they replace: codes, residuals, momentum
and decoded values bit for bit, block scales equal to the float64 reference."""
import collections

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.codes import SignCodes

pytest.importorskip("numba")
hc = pytest.importorskip("hvd_compress.pt")
from hvd_compress.pt import fused  # noqa: E402
from hvd_compress.pt.memory import ErrorFeedback  # noqa: E402
from hvd_compress.pt.packing import pack, unpack_scaled_signs  # noqa: E402
from hvd_compress.server import ServerStep  # noqa: E402

from .harness import run_parallel  # noqa: E402

LENGTHS = [1, 7, 8, 4097, 100_003]
BLOCKS = [None, 7, 256, 4096]


def _vector(numel, seed, bad=None):
    v = torch.from_numpy(np.random.default_rng(seed).standard_normal(numel).astype(np.float32))
    v[::97] = 0  # sign(0) = +1
    if bad is not None:
        v[numel // 2] = bad
    return v


def _eager_message(codec, p, scale):
    """What the pipeline's eager calls send and keep for ``p`` under ``scale``."""
    codes = codec.encode(p, scale, None)
    sent = codec.decode(codec.values(codes), scale, 1)
    return pack(codes.reshape(1, -1), SignCodes()).reshape(-1), p - sent


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_worker_step_is_the_eager_step(block, numel, bad):
    codec, reference = hc.BlockSign(block), hvd_compress.BlockSign(block)
    vector = _vector(numel, numel, bad)
    for residual, ratio in ((None, 1.0), (_vector(numel, 1) / 10, 1.0), (_vector(numel, 2), 0.3)):
        memory = ErrorFeedback()
        if residual is not None:
            memory.residuals["x"] = residual
        want = memory.compensate("x", vector, ratio)
        p, scale = fused.compensated_scale(codec, vector, residual, ratio)
        np.testing.assert_array_equal(p.numpy(), want.numpy())
        np.testing.assert_array_equal(scale.numpy(), reference.local_scale(want.numpy()))
        packed, kept = fused.signs_with_feedback(codec, p, scale)
        want_packed, want_kept = _eager_message(codec, p, scale)
        np.testing.assert_array_equal(packed.numpy(), want_packed.numpy())
        np.testing.assert_array_equal(kept.numpy(), want_kept.numpy())  # NaN where eager has
        if bad is not None:
            assert np.isinf(scale.numpy()).all() and np.isnan(kept.numpy()).all()


def _server_inputs(rows, numel, seed):
    rng = np.random.default_rng(seed)
    signs = torch.from_numpy(rng.choice(np.array([-1, 1], dtype=np.int8), (rows, numel)))
    packed = pack(signs, SignCodes())
    # Sliced after a head of scales, as the received rows are: not contiguous.
    received = torch.cat([torch.zeros(rows, 4, dtype=torch.uint8), packed], dim=1)[:, 4:]
    return received, torch.from_numpy(rng.uniform(0.1, 2.0, rows).astype(np.float32))


@pytest.mark.parametrize("block", [None, 7, 4096])
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("rows", [1, 4])
def test_server_step_is_the_eager_server_step(block, numel, rows):
    codec, reference = hc.BlockSign(block), hvd_compress.BlockSign(block)
    bits, scales = _server_inputs(rows, numel, numel + rows)
    for residual, ratio in ((None, 1.0), (_vector(numel, 3) / 10, 0.5)):
        average = unpack_scaled_signs(bits, scales.reshape(rows, 1), numel).sum(dim=0) / rows
        eager_memory, fused_memory = ErrorFeedback(), ErrorFeedback()
        if residual is not None:
            eager_memory.residuals["s"] = fused_memory.residuals["s"] = residual
        p = eager_memory.compensate("s", average, ratio)
        packed, scale = fused.server_step(ServerStep(fused_memory, "s", ratio), codec, bits,
                                          scales, rows, numel)
        np.testing.assert_array_equal(scale.numpy(), reference.local_scale(p.numpy()))
        want_packed, want_kept = _eager_message(codec, p, scale)
        np.testing.assert_array_equal(packed.numpy(), want_packed.numpy())
        np.testing.assert_array_equal(fused_memory.proposed["s"].numpy(), want_kept.numpy())


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("bad", [None, float("nan")])
def test_replicated_server_is_the_eager_server_step(numel, bad):
    from hvd_compress.pt.exchange import Allgather, Meter
    from hvd_compress.pt.packing import unpack
    codec, reference = hc.BlockSign(), hvd_compress.BlockSign()
    bits, scales = _server_inputs(4, numel, numel)
    if bad is not None:
        scales[2] = bad
    # The gathered rows: each worker's scale as raw bytes, then its packed signs.
    rows = torch.cat([scales.reshape(4, 1).view(torch.uint8), bits], dim=1)
    residual = _vector(numel, 5) / 10
    memory = ErrorFeedback()
    memory.residuals["t"] = residual
    exchange = Allgather(codec, numel, 4, Meter(), 4, ServerStep(memory, "t", 0.5))
    got = exchange._serve(rows)
    # The eager replicated server: every message decoded, summed, divided, compensated.
    values = codec.values(unpack(bits, SignCodes(), numel))
    average = codec.decode(values, scales.reshape(4, 1), 1).sum(dim=0) / 4
    eager_memory = ErrorFeedback()
    eager_memory.residuals["t"] = residual
    p = eager_memory.compensate("t", average, 0.5)
    scale = torch.from_numpy(np.asarray(reference.local_scale(p.numpy()), dtype=np.float32))
    _, want_kept = _eager_message(codec, p, scale)
    sent = codec.decode(codec.values(codec.encode(p, scale, None)), scale, 1)
    np.testing.assert_array_equal(got.numpy(), sent.numpy())
    np.testing.assert_array_equal(memory.proposed["t"].numpy(), want_kept.numpy())
    assert exchange.finite is (bad is None)


@pytest.mark.parametrize("numel", LENGTHS)
def test_scaled_signs_are_the_eager_table_gather(numel):
    bits, _ = _server_inputs(4, numel, numel)
    scales = torch.tensor([[0.25], [3e-30], [float("inf")], [float("nan")]])
    for length in {numel, max(numel - 3, 1)}:
        got = fused.scaled_signs(bits, scales, length)
        want = unpack_scaled_signs(bits, scales, length)
        assert got.shape == want.shape == (4, length)
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def _eager_momentum(grad, buffer, mu, nesterov):
    """``WorkerMomentum.before_exchange``'s eager ops: (new m, u)."""
    u = grad.clone()
    m = torch.add(u, buffer, alpha=mu)
    if nesterov:
        u.add_(m, alpha=mu)
    else:
        u.copy_(m)
    return m, u


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_is_the_eager_momentum(nesterov):
    grad, buffer = _vector(1_000_003, 4), _vector(1_000_003, 5)
    want_buffer, want_grad = _eager_momentum(grad, buffer, 0.9, nesterov)
    got_buffer = fused.momentum(grad, buffer, 0.9, nesterov)
    assert torch.equal(got_buffer, want_buffer) and torch.equal(grad, want_grad)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("block", [None, 7, 4096])
def test_deferred_momentum_is_the_eager_momentum_then_compensation(nesterov, block):
    from hvd_compress.pt.momentum import WorkerMomentum
    codec, reference = hc.BlockSign(block), hvd_compress.BlockSign(block)
    grad, buffer = _vector(100_003, 6), _vector(100_003, 7)
    want_buffer, u = _eager_momentum(grad, buffer, 0.9, nesterov)
    for residual, ratio in ((None, 1.0), (_vector(100_003, 8) / 10, 0.7)):
        memory = ErrorFeedback()
        if residual is not None:
            memory.residuals["x"] = residual
        want = memory.compensate("x", u, ratio)
        deferred = WorkerMomentum.Deferred(buffer, 0.9, nesterov, torch.empty_like(grad))
        before = grad.clone()
        p, scale = fused.compensated_scale(codec, grad, residual, ratio, momentum=deferred)
        assert torch.equal(grad, before)  # u is not written back
        assert torch.equal(deferred.out, want_buffer) and torch.equal(p, want)
        np.testing.assert_array_equal(scale.numpy(), reference.local_scale(want.numpy()))


def test_kernels_are_only_for_cpu_float32_blocksign():
    assert fused.applies(hc.BlockSign(), torch.zeros(3))
    assert not fused.applies(hc.BlockSign(), torch.zeros(3, dtype=torch.float16))
    assert not fused.applies(hc.TernGrad(), torch.zeros(3))


_FUSED = ("momentum", "compensated_scale", "signs_with_feedback", "server_step",
          "scaled_signs")
# compensated_scale with a ``WorkerMomentum.Deferred``: momentum and compensation in one pass.
_DEFERRED = "compensated_scale+momentum"


def _train_counting_kernels(enabled, exchange):
    """dist-EF-blockSGDM (``test_dist_ef._train_ef``) with the kernels on or off; the last
    parameters and how often each fused call ran."""
    from hvd_compress.pt import fused

    from .test_dist_ef import _train_ef
    fused.ENABLED = enabled
    calls = collections.Counter()
    for name in _FUSED:
        def counted(*args, _original=getattr(fused, name), _name=name, **kwargs):
            calls[_name if kwargs.get("momentum") is None else _DEFERRED] += 1
            return _original(*args, **kwargs)
        setattr(fused, name, counted)
    return _train_ef(exchange, steps=20)["params"][-1], dict(calls)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, exchange", [(2, "allgather"), (4, "sharded")])
def test_optimizer_runs_the_kernels_and_trains_as_the_eager_calls(world, exchange):
    with_kernels = run_parallel(_train_counting_kernels, world, True, exchange)
    eager = run_parallel(_train_counting_kernels, world, False, exchange)
    used = set(with_kernels[0][1])
    # Every tensor is compressed, so its momentum is deferred to the compensation (the
    # momentum kernel of its own is for tensors sent whole); the replicated server
    # (allgather) and the sharded one both run the server's kernels.
    want = set(_FUSED) - {"momentum"} | {_DEFERRED}
    assert used == want, used
    assert not eager[0][1]
    for (params, _), (eager_params, _) in zip(with_kernels, eager):
        # The eager scales are within 3e-7 of the float64 ones the kernels compute.
        torch.testing.assert_close(params, eager_params, rtol=1e-4, atol=1e-5)
