"""Property-based tests (hypothesis) of every codec over shapes, dtypes and parameter ranges:
each input either round-trips through scales, codes, the packed wire format and decoding, or
is refused with a clear error; and summed codes never overflow their carrier."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress import packing as np_packing
from hvd_compress.cost import TORCH_ALLREDUCE_DTYPES
from hvd_compress.pt import elias, packing

from .devices import DEVICES

# Hyperparameters of every codec that has codes, including out-of-range values.
HYPERPARAMETERS = {
    "fp16": st.just({}),
    "terngrad": st.fixed_dictionaries(
        {"clip": st.sampled_from([0.0, 1.0, 2.5, 10.0]), "min_size": st.integers(0, 5)}
    ),
    "qsgd": st.fixed_dictionaries(
        {
            "bits": st.integers(0, 9),
            "bucket_size": st.integers(0, 300),
            "min_size": st.just(0),
            "wire": st.sampled_from(["fixed", "elias"]),
        }
    ),
    "qsgd-inf": st.fixed_dictionaries(
        {"bits": st.integers(0, 9), "bucket_size": st.integers(0, 300), "min_size": st.just(0)}
    ),
    "nuqsgd": st.fixed_dictionaries(
        {
            "bits": st.integers(0, 6),
            "bucket_size": st.integers(0, 300),
            "min_size": st.just(0),
            "wire": st.sampled_from(["fixed", "elias"]),
        }
    ),
    "ef-sign": st.fixed_dictionaries(
        {"max_block_size": st.one_of(st.none(), st.integers(0, 64)), "min_size": st.just(0)}
    ),
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = st.one_of(
    st.just(()), st.just((0,)), st.lists(st.integers(1, 37), min_size=1, max_size=3).map(tuple)
)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tensor(shape, dtype, magnitude, transpose, seed, device):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) * magnitude).to(dtype)
    x = x.to(device)
    # A transposed view is not contiguous: codecs must flatten it in logical order.
    return x.t() if transpose and x.dim() == 2 else x


@pytest.mark.parametrize("name", sorted(HYPERPARAMETERS))
@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    data=st.data(),
    shape=SHAPES,
    dtype=st.sampled_from(DTYPES),
    magnitude=st.sampled_from([0.0, 1e-30, 1e-12, 1e-3, 1.0, 1e4]),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_through_the_wire(name, device, data, shape, dtype, magnitude, transpose, seed):
    params = data.draw(HYPERPARAMETERS[name])
    try:
        codec, reference = hc.CODECS[name](**params), hvd_compress.CODECS[name](**params)
    except ValueError as error:
        assert any(f" {key} must" in str(error) for key in params), error
        return
    x = _tensor(shape, dtype, magnitude, transpose, seed, device)
    flat = x.reshape(-1)
    if not codec.compresses(flat.numel()):
        return  # sent whole by the optimizer's plain allreduce
    scale = codec.local_scale(flat) if codec.scaled else None
    uniforms = (
        torch.rand(flat.shape, generator=torch.Generator().manual_seed(seed)).to(device)
        if codec.stochastic
        else None
    )
    codes = codec.encode(flat, scale, uniforms)
    if codec.wire == "elias":
        wire = elias.encode(codes)
        received = elias.decode(wire, flat.numel())
    else:
        wire = packing.pack(codes.reshape(1, -1), codec.code_space)
        received = packing.unpack(wire, codec.code_space, flat.numel()).reshape(-1)
    assert torch.equal(received.to(codes.dtype), codes)
    decoded = codec.decode(codec.values(received), scale, 1)
    assert decoded.dtype == torch.float32 and decoded.shape == flat.shape
    if name == "fp16":
        # Beyond float16's range this is inf, as with Horovod's own fp16 compression: a
        # non-finite gradient that every rank sees, so a GradScaler skips the step.
        assert torch.equal(decoded, flat.to(torch.float16).to(torch.float32))
        return
    assert torch.isfinite(decoded).all()

    exact = flat.to(torch.float64)
    full = scale.repeat_interleave(codec.bucket_length(flat.numel()))[: flat.numel()]
    # Every codec here keeps the sign and never exceeds its bucket's scale.
    assert (decoded.to(torch.float64) * exact >= 0).all()
    assert (decoded.abs() <= full * (1 + 1e-6)).all()
    if name == "ef-sign":
        assert torch.equal(decoded.abs(), full) and ((decoded >= 0) == (exact >= 0)).all()

    # The numpy reference puts the same bytes on the wire (it has no bfloat16).
    if dtype is not torch.bfloat16:
        g = flat.cpu().numpy()
        ref_scale = reference.local_scale(g) if codec.scaled else None
        np.testing.assert_allclose(ref_scale, scale.cpu().numpy(), rtol=1e-6)
        ref_codes = reference.encode(
            g, scale.cpu().numpy(), None if uniforms is None else uniforms.cpu().numpy()
        )
        ref_wire = (
            hvd_compress.elias.encode(ref_codes)
            if codec.wire == "elias"
            else np_packing.pack(ref_codes.reshape(1, -1), codec.code_space)
        )
        np.testing.assert_array_equal(ref_wire, wire.cpu().numpy())


def _numpy(x):
    return x.to(torch.float32 if x.dtype == torch.bfloat16 else x.dtype).cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    shape=SHAPES,
    dtype=st.sampled_from(DTYPES),
    bin_length=st.integers(1, 600),
    magnitude=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e4]),
    transpose=st.booleans(),
    zero_bins=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adacomp_messages_round_trip(
    device, shape, dtype, bin_length, magnitude, transpose, zero_bins, seed
):
    codec, reference = hc.AdaComp(min_size=0), hvd_compress.AdaComp(min_size=0)
    grad = _tensor(shape, dtype, magnitude, transpose, seed, device)
    compensated = grad + _tensor(shape, dtype, magnitude, transpose, seed + 1, device)
    # A float16 sum of two values near 1e4 may overflow: a non-finite residue makes the whole
    # message NaN by design (test_adacomp.py, test_non_finite_residue_decodes_to_nan_everywhere).
    assume(bool(torch.isfinite(compensated).all()))
    if zero_bins:
        keep = torch.arange(compensated.numel(), device=device) >= 2 * bin_length
        compensated = torch.where(keep.reshape(compensated.shape), compensated, 0)
    numel = grad.numel()
    selected = codec.select(compensated, grad, bin_length)
    message = codec.encode_message(compensated, selected, bin_length)
    sent = codec.decode_message(message, numel, bin_length)
    count = int(selected.sum())
    assert message.dtype == torch.uint8
    assert message.numel() == codec.message_nbytes(numel, bin_length, count)
    # Sent exactly where selected, with the residue's sign; an all-zero bin sends nothing.
    assert sent.dtype == torch.float32 and sent.shape == (numel,)
    assert torch.equal(sent != 0, selected)
    flat = compensated.reshape(-1).to(torch.float64)
    assert (sent.to(torch.float64) * flat >= 0).all()
    if zero_bins:
        assert not selected[: 2 * bin_length].any()
    # The reference selects the same elements and writes the same bytes (no bfloat16 there).
    if dtype is not torch.bfloat16:
        ref_selected = reference.select(_numpy(compensated), _numpy(grad), bin_length)
        np.testing.assert_array_equal(ref_selected, selected.cpu().numpy())
        np.testing.assert_array_equal(
            reference.encode_message(_numpy(compensated), ref_selected, bin_length),
            message.cpu().numpy(),
        )


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    shape=SHAPES,
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
    magnitude=st.sampled_from([0.0, 1e-30, 1.0, 1e4]),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_clt_k_selects_exactly_the_largest(device, shape, dtype, data, magnitude, transpose, seed):
    x = _tensor(shape, dtype, magnitude, transpose, seed, device)
    numel = x.numel()
    if numel == 0:
        return  # nothing to select: the optimizer sends empty tensors whole
    ratio = data.draw(st.integers(1, 2 * numel))
    codec = hc.CyclicLocalTopK(ratio=ratio, min_size=0)
    k = codec.k(numel)
    indices = codec.top_k(x, k)
    assert indices.dtype == torch.int32 and indices.numel() == k
    assert (indices[1:] > indices[:-1]).all()  # ascending, no repeats
    magnitude = x.reshape(-1).to(torch.float32).abs()
    taken = torch.zeros(numel, dtype=torch.bool, device=device)
    taken[indices.long()] = True
    if k < numel:
        assert magnitude[taken].min() >= magnitude[~taken].max()
    np.testing.assert_array_equal(
        hvd_compress.CyclicLocalTopK(ratio=ratio, min_size=0).top_k(_numpy(x), k),
        indices.cpu().numpy(),
    )


@pytest.mark.parametrize("name", sorted(HYPERPARAMETERS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("device", DEVICES)
def test_integer_tensors_pass_through_horovods_hook(name, dtype, device):
    codec = hc.CODECS[name]()
    x = torch.arange(10).to(device, dtype)
    if codec.scaled:
        with pytest.raises(TypeError, match="DistributedOptimizer"):
            codec.compress(x)
        return
    compressed, context = codec.compress(x)
    assert torch.equal(codec.decompress(compressed, context), x)


@pytest.mark.parametrize(
    "name,params",
    [
        ("terngrad", {}),
        ("qsgd", {"bits": 8}),
        ("qsgd-inf", {"bits": 8}),
        ("nuqsgd", {"bits": 5}),
        ("fp16", {}),
    ],
)
@pytest.mark.parametrize("world", [2, 3, 127, 128, 1024, 2047, 2048])
@pytest.mark.parametrize("device", DEVICES)
def test_summed_codes_fit_their_carrier_up_to_2048_workers(name, params, world, device):
    codec = hvd_compress.CODECS[name](**params)
    space = codec.value_space
    carrier = getattr(torch, space.allreduce_carrier(world, TORCH_ALLREDUCE_DTYPES))
    if name == "fp16":
        return  # float sums round, as Horovod's own fp16 compression does
    # The worst case: every worker sends the largest code, summed one by one in the carrier
    # as a ring allreduce does.
    total = torch.zeros((), dtype=carrier)
    for _ in range(world):
        total += torch.tensor(space.bound, dtype=carrier)
    assert int(total) == space.bound * world
    # The sharded exchange re-packs the sums in the space of the sum: exact round trip.
    summed = space.summed(world)
    extremes = torch.tensor([[-summed.bound, summed.bound, 0, 1 - summed.bound]], device=device)
    assert torch.equal(packing.unpack(packing.pack(extremes, summed), summed, 4), extremes.int())
