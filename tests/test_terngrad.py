"""TernGrad against the numpy reference and the paper's identities."""

import numpy as np
import pytest
import torch

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress import simulate
from hvd_compress.seeding import stream_seed, uniforms

from .devices import DEVICES


def gaussian(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_local_scale_is_clipped_max_norm():
    g = gaussian(10_000)
    ref = hvd_compress.TernGrad(clip=2.5)
    sigma = g.std()
    assert ref.local_scale(g) == pytest.approx(min(2.5 * sigma, np.abs(g).max()), rel=1e-6)
    assert hvd_compress.TernGrad(clip=0).local_scale(g) == np.abs(g).max()
    small = np.array([1.0, -1.0], np.float32)  # 2.5 sigma > max|g|: the max wins
    assert ref.local_scale(small) == 1.0


@pytest.mark.parametrize("kernels", [False, True])
def test_scale_when_the_mean_dwarfs_the_spread(monkeypatch, kernels):
    """sigma from one pass of sums shifted by g[0]: exact for a constant gradient (0) and
    within float32 rounding of the exact sigma when the mean is 10^6 spreads, in the
    reference, the torch port's eager ops and the kernels."""
    from hvd_compress.pt import fused

    monkeypatch.setattr(fused, "ENABLED", kernels and fused.ENABLED)
    if kernels and not fused.ENABLED:
        pytest.skip("numba is not installed")
    ref, port = hvd_compress.TernGrad(clip=2.5), hc.TernGrad(clip=2.5)
    constant = np.full(10_001, 0.1, np.float32)
    assert ref.local_scale(constant)[0] == 0
    assert port.local_scale(torch.from_numpy(constant)).item() == 0
    g = (1000 + 1e-3 * gaussian(10_001)).astype(np.float32)
    exact = 2.5 * np.sqrt(np.mean((g.astype(np.float64) - np.mean(g.astype(np.float64))) ** 2))
    assert ref.local_scale(g)[0] == pytest.approx(exact, rel=1e-6)
    assert port.local_scale(torch.from_numpy(g)).item() == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("clip", [0.0, 2.5])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_port_matches_reference(clip, device):
    g = gaussian(50_001, seed=1) * 1e-3
    u = np.random.default_rng(2).random(g.size).astype(np.float32)
    ref, port = hvd_compress.TernGrad(clip=clip), hc.TernGrad(clip=clip)
    scale = ref.local_scale(g)
    g_pt, scale_pt = torch.from_numpy(g).to(device), torch.from_numpy(scale).to(device)
    assert port.local_scale(g_pt).item() == pytest.approx(scale, rel=1e-6)
    codes = ref.encode(g, scale, u)
    codes_pt = port.encode(g_pt, scale_pt, torch.from_numpy(u).to(device))
    np.testing.assert_array_equal(codes_pt.cpu().numpy(), codes)
    total = np.stack([codes, -codes, codes]).sum(0)
    np.testing.assert_array_equal(
        port.decode(torch.from_numpy(total).to(device), scale_pt, 3).cpu().numpy(),
        ref.decode(total, scale, 3),
    )


def test_decoded_values_are_ternary():
    g = gaussian(4096)
    ref = hvd_compress.TernGrad()
    s = ref.local_scale(g)
    codes = ref.encode(g, s, np.random.default_rng(0).random(g.size))
    assert set(np.unique(codes)) <= {-1, 0, 1}
    assert set(np.unique(ref.decode(codes, s, 1))) <= {-s[0], 0, s[0]}


@pytest.mark.parametrize("device", DEVICES)
def test_unbiasedness_identity_is_exact(device):
    """s * P(b = 1) = min(|g|, s) elementwise, on the probability tensor itself."""
    g = gaussian(100_000, seed=3)
    ref = hvd_compress.TernGrad()
    s = ref.local_scale(g)
    np.testing.assert_allclose(
        s * ref.probabilities(g, s), np.minimum(np.abs(g), s), rtol=1e-6, atol=0
    )
    port = hc.TernGrad()
    p = port.probabilities(torch.from_numpy(g).to(device), torch.from_numpy(s).to(device))
    p = p.cpu().numpy()
    np.testing.assert_array_equal(p, ref.probabilities(g, s))


def test_empirical_mean_and_variance_over_seeds():
    g = gaussian(2000, seed=4)
    ref = hvd_compress.TernGrad()
    s = ref.local_scale(g)
    clipped = np.clip(g, -s, s)
    draws = 4000
    # The pipeline's draws: the streams of ``draws`` steps.
    samples = np.stack(
        [
            ref.decode(ref.encode(g, s, uniforms(stream_seed(5, 0, step, 0), g.size)), s, 1)
            for step in range(draws)
        ]
    )
    # Exact variance of each element: s * min(|g|, s) - min(|g|, s)^2.
    a = np.minimum(np.abs(g), s)
    variance = a * (s - a)
    error = samples.astype(np.float64).mean(0) - clipped
    # The total error is within 4 sigma of zero ...
    assert abs(error.sum()) <= 4 * np.sqrt(variance.sum() / draws)
    # ... and the per-element z-scores have unit mean square (chi-square with 2000 degrees of
    # freedom: its mean is 1 +- 0.032), so no element is biased either.
    z = error[variance > 0] / np.sqrt(variance[variance > 0] / draws)
    assert abs(np.mean(z**2) - 1) <= 4 * np.sqrt(2 / z.size)
    # Variance identity, summed: sum_k |g_k| (s - |g_k|) (clipped elements contribute 0).
    total = np.sum(variance)
    measured = np.sum(samples.var(0))
    assert measured == pytest.approx(total, rel=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_and_non_finite_gradients(device):
    ref, port = hvd_compress.TernGrad(), hc.TernGrad()
    zero = np.zeros(100, np.float32)
    assert ref.local_scale(zero)[0] == 0
    assert not ref.encode(zero, ref.local_scale(zero), np.random.default_rng(0).random(100)).any()
    bad = gaussian(100)
    bad[7] = np.nan
    assert ref.local_scale(bad)[0] == np.inf
    assert port.local_scale(torch.from_numpy(bad).to(device)).item() == np.inf
    bad[7] = np.inf
    assert port.local_scale(torch.from_numpy(bad).to(device)).item() == np.inf
    decoded = port.decode(
        torch.zeros(100, dtype=torch.int32, device=device), torch.tensor([np.inf], device=device), 2
    )
    assert torch.isnan(decoded).all()


@pytest.mark.parametrize("exchange", ["allreduce", "allgather", "sharded"])
def test_simulated_average_is_on_the_shared_grid(exchange):
    world = 4
    grads = [gaussian(999, seed=10 + r) * (r + 1) for r in range(world)]
    uniforms = [np.random.default_rng(20 + r).random(999) for r in range(world)]
    ref = hvd_compress.TernGrad()
    averaged = simulate.exchange_step(ref, grads, uniforms, exchange)
    s = max(ref.local_scale(g) for g in grads)
    k = averaged * world / s
    np.testing.assert_allclose(k, np.round(k), atol=1e-4)
    assert np.abs(k).max() <= world


@pytest.mark.parametrize("device", DEVICES)
def test_horovod_compressor_interface(device):
    fp16 = hc.FP16()
    t = torch.randn(10).to(device)
    payload, ctx = fp16.compress(t)
    assert payload.dtype == torch.float16 and fp16.decompress(payload, ctx).dtype == torch.float32
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        hc.TernGrad().compress(t)
