"""QSGD, QSGD-inf and NUQSGD against the numpy reference and the papers' bounds."""

import numpy as np
import pytest
import torch

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress.qsgd import nuqsgd_variance_bound, qsgd_variance_bound
from hvd_compress.seeding import stream_seed, uniforms

from .devices import DEVICES

CODECS = [
    ("qsgd", {}),
    ("qsgd-inf", {}),
    ("nuqsgd", {"bucket_size": 2048}),
    ("qsgd", {"bits": 2, "bucket_size": 128}),
    ("nuqsgd", {"bits": 5, "bucket_size": 100}),
]


def reference(name, **params):
    return hvd_compress.CODECS[name](**params)


def inputs(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal(n).astype(np.float32)
    return rng.standard_t(1.5, n).astype(np.float32)  # heavy tails, infinite variance


@pytest.mark.parametrize("name,params", CODECS)
@pytest.mark.parametrize("device", DEVICES)
def test_rounding_identity_and_port_agreement(name, params, device):
    g = inputs("gaussian", 10_007)
    ref, port = reference(name, **params), hc.CODECS[name](**params)
    scale = ref.local_scale(g)
    g_pt, scale_pt = torch.from_numpy(g).to(device), torch.from_numpy(scale).to(device)
    np.testing.assert_allclose(port.local_scale(g_pt).cpu().numpy(), scale, rtol=1e-6)
    lo, hi, p = ref.rounding(g, scale)[:3]
    full = np.repeat(scale, ref.bucket_length(g.size))[: g.size]
    r = np.abs(g) / full
    if name != "nuqsgd":  # uniform levels come as level numbers, NUQSGD's as fractions
        lo, hi = lo / ref.levels, hi / ref.levels
    assert np.all((lo <= r + 1e-6) & (r <= hi + 1e-6)) and np.all((p >= 0) & (p <= 1))
    np.testing.assert_allclose(lo + p * (hi - lo), r, rtol=1e-5, atol=1e-7)
    u = np.random.default_rng(1).random(g.size).astype(np.float32)
    codes = ref.encode(g, scale, u)
    assert np.abs(codes).max() <= ref.code_space.bound
    codes_pt = port.encode(g_pt, scale_pt, torch.from_numpy(u).to(device))
    np.testing.assert_array_equal(codes_pt.cpu().numpy(), codes)
    values = ref.values(codes)
    np.testing.assert_array_equal(
        port.values(torch.from_numpy(codes).to(device)).cpu().numpy(), values
    )
    assert np.abs(values).max() <= ref.value_space.bound
    np.testing.assert_array_equal(
        port.decode(torch.from_numpy(values).to(device), scale_pt, 2).cpu().numpy(),
        ref.decode(values, scale, 2),
    )


def _samples(codec, g, draws, seed):
    """Decoded messages of ``g`` with the draws of ``draws`` steps of the pipeline's
    streams (``seeding.uniforms``)."""
    scale = codec.local_scale(g)
    return np.stack(
        [
            codec.decode(
                codec.values(
                    codec.encode(g, scale, uniforms(stream_seed(seed, 0, step, 0), g.size))
                ),
                scale,
                1,
            )
            for step in range(draws)
        ]
    ).astype(np.float64)


@pytest.mark.parametrize("name,params", CODECS[:3])
def test_unbiased_over_seeds(name, params):
    codec = reference(name, **params)
    g = inputs("gaussian", 4096, seed=2)
    draws = 2000
    samples = _samples(codec, g, draws, seed=3)
    error = samples.mean(0) - g
    variance = samples.var(0)
    assert abs(error.sum()) <= 4 * np.sqrt(variance.sum() / draws)
    z = error[variance > 0] / np.sqrt(variance[variance > 0] / draws)
    assert abs(np.mean(z**2) - 1) <= 4 * np.sqrt(2 / z.size) + 0.02


@pytest.mark.parametrize("kind", ["gaussian", "heavy-tailed"])
@pytest.mark.parametrize("name", ["qsgd", "nuqsgd"])
def test_variance_below_the_papers_bounds(name, kind):
    d = 8192
    codec = reference(name, bits=4, bucket_size=d)
    g = inputs(kind, d, seed=4)
    samples = _samples(codec, g, 200, seed=5)
    relative = np.mean(np.sum((samples - g) ** 2, axis=1)) / np.sum(g.astype(np.float64) ** 2)
    if name == "qsgd":
        bound = qsgd_variance_bound(d, codec.levels)
    else:
        bound = nuqsgd_variance_bound(d, codec.exponent)
    assert relative <= bound


def test_nuqsgd_has_lower_variance_than_qsgd_at_four_bits():
    g = inputs("gaussian", 8192, seed=6)
    variance = {}
    for name in ("qsgd", "nuqsgd"):
        samples = _samples(reference(name, bits=4, bucket_size=8192), g, 100, seed=7)
        variance[name] = np.mean(np.sum((samples - g) ** 2, axis=1))
    assert variance["nuqsgd"] < variance["qsgd"] / 2


@pytest.mark.parametrize("name", ["qsgd", "qsgd-inf", "nuqsgd"])
def test_zero_bucket_decodes_to_zeros(name):
    codec = reference(name, bucket_size=4)
    g = np.array([0, 0, 0, 0, 1, -2, 0, 3], np.float32)
    scale = codec.local_scale(g)
    assert scale[0] == 0
    out = codec.decode(codec.values(codec.encode(g, scale, np.full(8, 0.5))), scale, 1)
    assert np.all(out[:4] == 0) and np.isfinite(out).all()


def test_one_level_qsgd_inf_is_terngrad_without_clipping():
    g = inputs("gaussian", 5000, seed=8)
    u = np.random.default_rng(9).random(g.size)
    qsgd = reference("qsgd-inf", bits=2, bucket_size=5000)
    terngrad = hvd_compress.TernGrad(clip=0)
    np.testing.assert_array_equal(qsgd.local_scale(g), terngrad.local_scale(g))
    np.testing.assert_array_equal(
        qsgd.encode(g, qsgd.local_scale(g), u), terngrad.encode(g, terngrad.local_scale(g), u)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_marks_the_tensor(device):
    g = inputs("gaussian", 3000)
    g[5] = np.inf
    for name in ("qsgd", "qsgd-inf", "nuqsgd"):
        codec = hc.CODECS[name](bucket_size=1000)
        g_pt = torch.from_numpy(g).to(device)
        scale = codec.local_scale(g_pt)
        assert torch.isinf(scale).all()
        codes = codec.encode(g_pt, scale, torch.rand(3000).to(device))
        assert torch.isnan(codec.decode(codec.values(codes), scale, 1)).all()


@pytest.mark.parametrize("name", ["qsgd", "qsgd-inf", "nuqsgd"])
def test_bad_hyperparameters(name):
    cls = hc.CODECS[name]
    for bits in (1, cls.max_bits + 1):
        with pytest.raises(ValueError, match=rf"bits must be in \[2, {cls.max_bits}\]"):
            cls(bits=bits)
    with pytest.raises(ValueError, match="bucket_size must be >= 1"):
        cls(bucket_size=0)
    with pytest.raises(TypeError, match="bits must be an integer"):
        cls(bits=4.0)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        cls().compress(torch.zeros(3))


def test_elias_round_trip_of_every_integer_up_to_a_million():
    from hvd_compress import elias

    values = np.arange(1, 1_000_001)
    code, length = elias.omega_codes(values)
    # Spot-check the bit patterns against the textbook definition ...
    for k, want in {
        1: "0",
        2: "100",
        3: "110",
        4: "101000",
        16: "10100100000",
        1_000_000: "1010010011" + format(1_000_000, "b") + "0",
    }.items():
        assert format(int(code[k - 1]), "b").zfill(int(length[k - 1])) == want
    # ... and decode all of them as one stream of levels (gap 1 each, positive).
    decoded = elias.decode(elias.encode(values), values.size)
    np.testing.assert_array_equal(decoded, values)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("device", DEVICES)
def test_elias_round_trip_of_code_vectors_in_both_ports(density, device):
    from hvd_compress import elias
    from hvd_compress.pt import elias as pt_elias

    rng = np.random.default_rng(int(density * 100))
    codes = (rng.integers(-7, 8, 30_001) * (rng.random(30_001) < density)).astype(np.int8)
    data = elias.encode(codes)
    np.testing.assert_array_equal(elias.decode(data, codes.size), codes)
    data_pt = pt_elias.encode(torch.from_numpy(codes).to(device))
    np.testing.assert_array_equal(data_pt.cpu().numpy(), data)
    np.testing.assert_array_equal(pt_elias.decode(data_pt, codes.size).cpu().numpy(), codes)


def test_elias_wire_is_allgather_only():
    codec = hc.QSGDInf(wire="elias")
    assert not codec.summable
    with pytest.raises(ValueError, match="wire must be one of 'fixed', 'elias'"):
        hc.QSGDInf(wire="huffman")
