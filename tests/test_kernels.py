"""The fused CPU kernels (``hvd_compress.kernels`` through ``hvd_compress.pt.fused``) against
the eager codec, memory, server and exchange calls they replace: ef-sign's codes,
residuals, momentum and decoded values, and TernGrad's and the QSGD family's draws, packed
codes, residuals, partial sums and decoded values bit for bit; scales equal to the float64
reference."""

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
    for residual, lr_ratio in (
        (None, 1.0),
        (_vector(numel, 1) / 10, 1.0),
        (_vector(numel, 2), 0.3),
    ):
        memory = ErrorFeedback()
        if residual is not None:
            memory.residuals["x"] = residual
        want = memory.compensate("x", vector, lr_ratio)
        p, scale = fused.compensated_scale(codec, vector, residual, lr_ratio)
        np.testing.assert_array_equal(p.numpy(), want.numpy())
        np.testing.assert_array_equal(scale.numpy(), reference.local_scale(want.numpy()))
        want_packed, want_kept = _eager_message(codec, p, scale)
        # Into a new residual, and over a copy of p (the pipeline's own compensated p).
        over = p.clone()
        for packed, kept in (
            fused.signs_with_feedback(codec, p, scale),
            fused.signs_with_feedback(codec, over, scale, in_place=True),
        ):
            np.testing.assert_array_equal(packed.numpy(), want_packed.numpy())
            np.testing.assert_array_equal(kept.numpy(), want_kept.numpy())  # NaN where eager
            if bad is not None:
                assert np.isinf(scale.numpy()).all() and np.isnan(kept.numpy()).all()
        assert kept.data_ptr() == over.data_ptr()


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
    for residual, lr_ratio in ((None, 1.0), (_vector(numel, 3) / 10, 0.5)):
        average = unpack_scaled_signs(bits, scales.reshape(rows, 1), numel).sum(dim=0) / rows
        eager_memory, fused_memory = ErrorFeedback(), ErrorFeedback()
        if residual is not None:
            eager_memory.residuals["s"] = fused_memory.residuals["s"] = residual
        p = eager_memory.compensate("s", average, lr_ratio)
        # Messages as the sharded server receives them: a head of 3 block scales (this
        # server's elements in block 1), then the signs.
        heads = torch.stack([scales + 1, scales, scales * 3], dim=1)
        messages = torch.cat([heads.view(torch.uint8), bits], dim=1)
        packed, scale = fused.server_step(
            ServerStep(fused_memory, "s", lr_ratio), codec, messages, 12, 1, rows, numel
        )
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
    got = exchange._serve(rows, scales[:1])
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
    for residual, lr_ratio in ((None, 1.0), (_vector(100_003, 8) / 10, 0.7)):
        memory = ErrorFeedback()
        if residual is not None:
            memory.residuals["x"] = residual
        want = memory.compensate("x", u, lr_ratio)
        deferred = WorkerMomentum.Deferred(buffer, 0.9, nesterov, torch.empty_like(grad))
        before = grad.clone()
        p, scale = fused.compensated_scale(codec, grad, residual, lr_ratio, momentum=deferred)
        assert torch.equal(grad, before)  # u is not written back
        assert torch.equal(deferred.out, want_buffer) and torch.equal(p, want)
        np.testing.assert_array_equal(scale.numpy(), reference.local_scale(want.numpy()))


def test_kernels_are_only_for_cpu_float32_fixed_width_codes():
    for codec in (hc.BlockSign(), hc.TernGrad(), hc.QSGD(), hc.QSGDInf(), hc.NUQSGD()):
        assert fused.applies(codec, torch.zeros(3))
        assert not fused.applies(codec, torch.zeros(3, dtype=torch.float16))
    for codec in (hc.QSGD(wire="elias"), hc.AdaComp(), hc.FP16(), hc.NoneCodec()):
        assert not fused.applies(codec, torch.zeros(3))


# compensated_scale with a ``WorkerMomentum.Deferred``: momentum and compensation in one pass.
_DEFERRED = "compensated_scale+momentum"
# The kernels' calls of each exchange's servers: the replicated one (allgather) decodes its
# own signs; the sharded ones frame the workers' shards and their own messages, and decode
# the gathered messages.
_SERVERS = {
    "allgather": ("server_step", "scaled_signs"),
    "sharded": ("sharded_messages", "server_step", "server_message", "servers_signs"),
}
_FUSED = ("momentum", "compensated_scale", "signs_with_feedback") + tuple(
    sorted({name for names in _SERVERS.values() for name in names})
)


def _train_counting_kernels(enabled, exchange):
    """dist-EF-blockSGDM (``test_dist_ef._train_ef``) with the kernels on or off; the last
    parameters and how often each fused call ran."""
    from hvd_compress.pt import fused

    from .pt_jobs import train_ef

    fused.ENABLED = enabled
    calls = collections.Counter()
    for name in _FUSED:
        # The defaults bind this iteration's kernel and name.
        def counted(*args, _original=getattr(fused, name), _name=name, **kwargs):  # noqa: B008
            calls[_name if kwargs.get("momentum") is None else _DEFERRED] += 1
            return _original(*args, **kwargs)

        setattr(fused, name, counted)
    return train_ef(exchange, steps=20)["params"][-1], dict(calls)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, exchange", [(2, "allgather"), (4, "sharded")])
def test_optimizer_runs_the_kernels_and_trains_as_the_eager_calls(world, exchange):
    with_kernels = run_parallel(_train_counting_kernels, world, True, exchange)
    eager = run_parallel(_train_counting_kernels, world, False, exchange)
    used = set(with_kernels[0][1])
    # Every tensor is compressed, so its momentum is deferred to the compensation (the
    # momentum kernel of its own is for tensors sent whole).
    want = {"compensated_scale", _DEFERRED, "signs_with_feedback", *_SERVERS[exchange]}
    assert used == want, used
    assert not eager[0][1]
    for (params, _), (eager_params, _) in zip(with_kernels, eager):
        # The eager scales are within 3e-7 of the float64 ones the kernels compute.
        torch.testing.assert_close(params, eager_params, rtol=1e-4, atol=1e-5)


# ----- TernGrad and the QSGD family -----

# Every width of codes (2, 4, 8 bits), NUQSGD's every exponent, buckets that end inside a
# byte, and (with the lengths) partial buckets and bytes.
QUANTIZERS = [
    hvd_compress.TernGrad(),
    hvd_compress.TernGrad(clip=0),
    hvd_compress.QSGD(bits=2, bucket_size=7),
    hvd_compress.QSGDInf(),
    hvd_compress.QSGDInf(bits=8, bucket_size=100),
    hvd_compress.NUQSGD(bits=2, bucket_size=9),
    hvd_compress.NUQSGD(bits=3, bucket_size=9),
    hvd_compress.NUQSGD(bucket_size=2048),
    hvd_compress.NUQSGD(bits=5, bucket_size=100),
    hvd_compress.QSGD(bucket_size=5000),  # buckets longer than the kernels' chunk
]


def _port(reference):
    return hvd_compress.resolve(reference, hc.CODECS)


def _eager(call, *args):
    """``call(*args)`` with the kernels off: the eager definition."""
    fused.ENABLED = False
    try:
        return call(*args)
    finally:
        fused.ENABLED = True


def _key(numel):
    from hvd_compress.seeding import stream_seed

    return stream_seed(numel, 3, 7, 11)


@pytest.mark.parametrize("numel", [0, 1, 9, 100_003])
def test_one_generator_in_numpy_torch_and_the_kernels(numel):
    """The reference, the torch ops and the kernels draw the same uniforms, and the codes
    the reference and the eager port make from them are those the kernels pack."""
    from hvd_compress import kernels, seeding
    from hvd_compress.pt import seeding as pt_seeding
    from hvd_compress.pt.exchange import Meter, make_exchange
    from hvd_compress.pt.packing import unpack

    for key in (_key(numel), 0, 2**63 - 1):
        want = seeding.uniforms(key, numel)
        assert want.dtype == np.float32 and ((want >= 0) & (want < 1)).all()
        np.testing.assert_array_equal(
            pt_seeding.uniforms(key, numel, torch.device("cpu")).numpy(), want
        )
        drawn = np.empty(numel, np.float32)
        kernels.draws(tuple(np.uint32(word) for word in seeding.key_words(key)), drawn)
        np.testing.assert_array_equal(drawn, want)
    if not numel:
        return
    g = _vector(numel, numel)
    for reference in QUANTIZERS:
        codec = _port(reference)
        scale = codec.local_scale(g)
        u = seeding.uniforms(_key(numel), numel)
        codes = reference.encode(g.numpy(), scale.numpy(), u)
        np.testing.assert_array_equal(
            _eager(codec.encode, g, scale, torch.from_numpy(u)).numpy(), codes
        )
        exchange = make_exchange("allgather", codec, numel, 1, Meter(), 1)
        packed, _ = fused.encode(codec, exchange, g, scale, _key(numel), feedback=False)
        np.testing.assert_array_equal(
            unpack(packed.reshape(1, -1), codec.code_space, numel)[0].numpy(), codes
        )


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_nuqsgd_codes_on_and_beside_every_level(bits):
    """The kernels' NUQSGD codes, read from r's exponent and significand bits, are the
    reference's at r on each level 2^-k, one float above and below it, 0, subnormal r, r = 1
    and beyond, and infinite g: under scales of 1, r = |g|."""
    from hvd_compress import seeding
    from hvd_compress.pt.exchange import Meter, make_exchange
    from hvd_compress.pt.packing import unpack

    reference = hvd_compress.NUQSGD(bits=bits, bucket_size=64)
    codec = _port(reference)
    levels = np.ldexp(np.float32(1), -np.arange(reference.exponent + 3)).astype(np.float32)
    edges = np.concatenate(
        [
            levels,
            np.nextafter(levels, np.float32(0)),
            np.nextafter(levels, np.float32(2)),
            np.float32([0, 1e-45, 1e-40, 2**-126, 1.5, 3e38, np.inf]),
        ]
    )
    # Every edge many times, under draws of both sides, and negated.
    g = np.tile(np.concatenate([edges, -edges]), 300).astype(np.float32)
    scale = np.ones(codec.buckets(g.size), np.float32)
    key = _key(g.size)
    want = reference.encode(g, scale, seeding.uniforms(key, g.size))
    exchange = make_exchange("allgather", codec, g.size, 1, Meter(), 1)
    packed, _ = fused.encode(
        codec, exchange, torch.from_numpy(g), torch.from_numpy(scale), key, feedback=False
    )
    got = unpack(packed.reshape(1, -1), codec.code_space, g.size)[0].numpy()
    np.testing.assert_array_equal(got, want)


def test_uniforms_are_uniform_and_streams_independent():
    """Chi-square of 2^20 draws in 256 cells, and the correlation of neighbouring draws and
    of the streams of neighbouring steps and ranks, within 5 standard errors."""
    from hvd_compress.seeding import stream_seed, uniforms

    n = 1 << 20
    u = uniforms(stream_seed(0, 0, 0, 0), n).astype(np.float64)
    counts = np.bincount((u * 256).astype(int), minlength=256)
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
    assert abs(chi2 - 255) <= 5 * np.sqrt(2 * 255)
    neighbours = (u[1:], uniforms(stream_seed(0, 0, 1, 0), n), uniforms(stream_seed(0, 1, 0, 0), n))
    for other in neighbours:
        m = min(len(other), n)
        assert abs(np.corrcoef(u[:m], other[:m])[0, 1]) <= 5 / np.sqrt(m)


def _eager_payload(codec, exchange, codes):
    """What the eager ``exchange.start`` hands over for ``codes``."""
    from hvd_compress.pt.packing import pack

    if exchange.name == "allreduce":
        return codec.values(codes).to(exchange.carrier)
    if exchange.name == "allgather":
        return pack(codes.reshape(1, -1), codec.code_space).reshape(-1)
    padded = codes.new_zeros(exchange.world_size * exchange.length)
    padded[: codes.numel()] = codes
    return pack(padded, codec.code_space)


@pytest.mark.parametrize("reference", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_quantizer_worker_step_is_the_eager_step(reference, numel, bad):
    """Scales, the payload of every exchange (packed codes of full and partial bytes and
    buckets, the sharded padding, allreduce values) and the residual."""
    from hvd_compress.pt import seeding
    from hvd_compress.pt.exchange import Meter, make_exchange

    codec = _port(reference)
    p = _vector(numel, numel, bad)
    scale = codec.local_scale(p)
    np.testing.assert_array_equal(scale.numpy(), reference.local_scale(p.numpy()))
    torch.testing.assert_close(_eager(codec.local_scale, p), scale, rtol=3e-7, atol=0)
    if bad is not None:
        assert torch.isinf(scale).all()
    codes = codec.encode(p, scale, seeding.uniforms(_key(numel), numel, p.device))
    sent = codec.decode(codec.values(codes), scale, 1)
    for name, world in (("allreduce", 4), ("allgather", 1), ("sharded", 3), ("sharded", 4)):
        exchange = make_exchange(name, codec, numel, world, Meter(), world)
        want = _eager_payload(codec, exchange, codes)
        for feedback in (False, True):
            calls = [fused.encode(codec, exchange, p, scale, _key(numel), feedback)]
            if not codec.shares_scale(name) and fused.scales_in_encode(codec, numel):
                *call, taken = fused.scaled_encode(codec, exchange, p, _key(numel), feedback)
                assert torch.equal(taken, scale)
                calls.append(call)
            for payload, residual in calls:
                assert payload.dtype == want.dtype and torch.equal(payload, want), name
                if feedback:
                    np.testing.assert_array_equal(residual.numpy(), (p - sent).numpy())
                else:
                    assert residual is None
    if bad is not None:
        assert torch.isnan(sent).all()


def _received(codec, rows, numel, seed):
    """Random packed codes as ``rows`` workers send them, sliced after a head of scale
    bytes as the gathered rows are (not contiguous)."""
    from hvd_compress.pt.packing import pack

    space = codec.code_space
    rng = np.random.default_rng(seed)
    codes = rng.integers(-space.bound, space.bound + 1, (rows, numel)).astype(np.int8)
    packed = pack(torch.from_numpy(codes), space)
    return torch.cat([torch.zeros(rows, 4, dtype=torch.uint8), packed], dim=1)[:, 4:]


def _scales(codec, numel, rows, seed, bad):
    scales = torch.from_numpy(
        np.random.default_rng(seed)
        .uniform(0.1, 2.0, (rows, codec.buckets(numel)))
        .astype(np.float32)
    )
    if bad is not None:
        scales[0, -1] = bad
    return scales


@pytest.mark.parametrize("reference", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("numel", [4097])
def test_allgather_eager_decode_row_by_row_is_the_kernels_sum(monkeypatch, reference, numel):
    """The allgather's eager decode (what CUDA tensors run), which unpacks one worker at a
    time and accumulates, gives the kernels' in-order sum bit for bit, shared scale or own
    scales."""
    from hvd_compress.pt.exchange import Allgather, Meter

    world = 5
    codec = _port(reference)
    exchange = Allgather(codec, numel, world, Meter(), world)
    own = _scales(codec, numel, world, numel + 1, None)
    head = own.view(torch.uint8) if exchange.own_scale else own[:, :0].view(torch.uint8)
    gathered = torch.cat([head, _received(codec, world, numel, numel + world)], dim=1)
    scale = None if exchange.own_scale else own[0]
    kernels = exchange.decode(gathered, scale)
    monkeypatch.setattr(fused, "ENABLED", False)
    np.testing.assert_array_equal(exchange.decode(gathered, scale).numpy(), kernels.numpy())


@pytest.mark.parametrize("reference", QUANTIZERS[::2], ids=repr)
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("bad", [None, float("nan")])
def test_quantizer_receiving_side_is_the_eager_exchange(reference, numel, world, bad):
    """What every exchange does with what arrives: the allreduce's decode of the summed
    values (int32 or float16 carrier), the allgather's decode of the rows' sum (shared
    scale) or of each row (own scales), the sharded exchange's partial sums (to 8, 16 and
    32-bit widths) and decode of the gathered sums."""
    from hvd_compress.pt.exchange import Meter, _sum_rows, make_exchange
    from hvd_compress.pt.packing import pack, unpack

    codec = _port(reference)
    space = codec.code_space
    rows = _received(codec, world, numel, numel + world)
    scale = _scales(codec, numel, 1, numel, bad)[0]
    values = codec.values(unpack(rows, space, numel))
    allreduce = make_exchange("allreduce", codec, numel, world, Meter(), world)
    for total in (_sum_rows(values).to(allreduce.carrier), _sum_rows(values)):
        eager_total = total if total.is_floating_point() else total.to(torch.int32)
        np.testing.assert_array_equal(
            fused.decoded_totals(codec, total, scale, world).numpy(),
            codec.decode(eager_total, scale, world).numpy(),
        )
    np.testing.assert_array_equal(
        fused.decoded_sums(codec, rows, scale, world, numel).numpy(),
        codec.decode(_sum_rows(values), scale, world).numpy(),
    )
    own = _scales(codec, numel, world, numel + 1, bad)
    messages = torch.cat([own.view(torch.uint8), rows], dim=1)
    np.testing.assert_array_equal(
        fused.decoded_own_scales(
            codec, messages, own.element_size() * own.shape[1], world, numel
        ).numpy(),
        codec.decode(values, own, world).sum(dim=0).numpy(),
    )
    sharded = make_exchange("sharded", codec, numel, world, Meter(), world)
    length, total_space = sharded.length, sharded.total_space
    received = _received(codec, world, length, numel + 2)
    summed = _sum_rows(codec.values(unpack(received, space, length)))
    assert torch.equal(
        fused.summed_codes(codec, received, length, total_space), pack(summed, total_space)
    )
    gathered = pack(
        torch.from_numpy(
            np.random.default_rng(numel + 3)
            .integers(-total_space.bound, total_space.bound + 1, (world, length))
            .astype(np.int64)
        ),
        total_space,
    )
    total = unpack(gathered, total_space, length).reshape(-1)[:numel]
    np.testing.assert_array_equal(
        fused.decoded_segments(codec, gathered, total_space, length, scale, world, numel).numpy(),
        codec.decode(total, scale, world).numpy(),
    )


def test_sum_widths_cover_every_packing():
    """The receiving-side cases above reach sums of 4, 8, 16 and 32 bits."""
    from hvd_compress.pt.exchange import Meter, make_exchange

    widths = {
        make_exchange("sharded", _port(r), 100, world, Meter(), world).total_space.width
        for r in QUANTIZERS[::2]
        for world in (1, 4)
    }
    assert {4, 8, 16, 32} <= widths, widths


_QUANTIZER_KERNELS = (
    "local_scale",
    "compensated_scale",
    "compensated",
    "encode",
    "scaled_encode",
    "decoded_totals",
    "summed_codes",
    "decoded_sums",
    "decoded_own_scales",
    "decoded_segments",
)
# Every exchange of the quantizers, with and without error feedback, at N = 4: the
# allreduce's float16 carrier, the allgather's shared (TernGrad) and own (QSGD) scales, the
# sharded sums of 4, 8 and 16 bits. Every tensor compressed: sums of codes are exact, where
# Horovod's float sums of tensors sent whole depend on what its fusion buffer held.
_WHOLE = {"min_size": 0, "compress_classifier": True}
_QUANTIZER_RUNS = [
    (hvd_compress.TernGrad(**_WHOLE), "allreduce", True),
    (hvd_compress.TernGrad(**_WHOLE), "allgather", False),
    (hvd_compress.TernGrad(**_WHOLE), "sharded", False),
    (hvd_compress.QSGDInf(**_WHOLE), "allgather", True),
    (hvd_compress.QSGD(bits=3, bucket_size=700, **_WHOLE), "sharded", True),
    (hvd_compress.NUQSGD(bucket_size=2048, **_WHOLE), "sharded", False),
]


def _train_quantizers_counting_kernels(enabled):
    """``pt_jobs.train`` of every run of ``_QUANTIZER_RUNS`` with the kernels
    on or off: the exchanged gradients and parameters of each step, and how often each
    fused call ran."""
    from hvd_compress.pt import fused

    from .pt_jobs import train

    fused.ENABLED = enabled
    calls = collections.Counter()
    for name in _QUANTIZER_KERNELS:
        # The defaults bind this iteration's kernel and name.
        def counted(*args, _original=getattr(fused, name), _name=name, **kwargs):  # noqa: B008
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(fused, name, counted)
    runs = [
        [
            (r["exchanged"], r["params"])
            for r in train(codec, exchange, error_feedback=ef)["records"]
        ]
        for codec, exchange, ef in _QUANTIZER_RUNS
    ]
    return runs, dict(calls)


@pytest.mark.multiprocess
def test_optimizer_runs_the_quantizer_kernels_and_trains_as_the_eager_calls():
    with_kernels = run_parallel(_train_quantizers_counting_kernels, 4, True)
    eager = run_parallel(_train_quantizers_counting_kernels, 4, False)
    assert set(with_kernels[0][1]) == set(_QUANTIZER_KERNELS), with_kernels[0][1]
    assert not eager[0][1]
    # Bit for bit: the kernels' scales are the float64 reference's, which the eager ops'
    # float64 sums round to as well here.
    for (runs, _), (eager_runs, _) in zip(with_kernels, eager):
        for run, eager_run in zip(runs, eager_runs):
            for (exchanged, params), (eager_exchanged, eager_params) in zip(run, eager_run):
                assert torch.equal(params, eager_params)
                for name, grad in exchanged.items():
                    assert torch.equal(grad, eager_exchanged[name]), name


def _added_per_step(cases, kernels=True):
    """What each (codec, exchange) of ``cases`` adds to one step of ``Net`` past its
    warm-up, over the step with ``none`` (``benchmarks.op_count``'s counts): top-level torch
    ops per compressed tensor, and reads of tensor values into Python. Without ``kernels``
    the step runs the eager path, as CUDA tensors do."""
    import horovod.torch as hvd
    from torch.profiler import ProfilerActivity, profile

    import hvd_compress.pt as hc
    from benchmarks.op_count import host_reads, top_level_aten_ops

    from .pt_jobs import Net

    hvd.init()
    inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def counts(codec, exchange):
        torch.manual_seed(0)
        model = Net()
        optimizer = hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            model.named_parameters(),
            compression=codec,
            exchange=exchange,
        )

        def step():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()

        for _ in range(max(3, codec.uncompressed_steps + 1)):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step()
        tensors = optimizer.compression_stats()["tensors"]
        compressed = sum(1 for _, _, route, _ in tensors if not route.startswith("allreduce ("))
        events = profiler.events()
        return top_level_aten_ops(events), host_reads(events), compressed

    codecs = {
        "terngrad": hc.TernGrad(min_size=100),
        "qsgd-inf": hc.QSGDInf(min_size=100),
        "nuqsgd": hc.NUQSGD(min_size=100),
        "ef-sign": hc.BlockSign(min_size=0),
        "fp16": hc.FP16(),
        "powersgd": hc.PowerSGD(start_iter=1, min_size=100),
    }
    enabled, fused.ENABLED = fused.ENABLED, kernels and fused.ENABLED
    try:
        baseline, baseline_reads, _ = counts(hc.NoneCodec(), "auto")
        added = {}
        for name, exchange in cases:
            ops, reads, compressed = counts(codecs[name], exchange)
            added[name, exchange] = ((ops - baseline) / compressed, reads - baseline_reads)
        return added
    finally:
        fused.ENABLED = enabled


@pytest.mark.multiprocess
def test_the_kernels_add_a_few_torch_ops_per_compressed_tensor():
    """On CPU a codec's work is the kernels' calls, which take and give arrays without
    torch's dispatcher, so over the allgather (the quantizers' exchange at N = 2) and
    ef-sign's sharded exchange (its large tensors' from N = 2) compression adds a few ops
    per compressed tensor: the collectives, the payloads, the result's view. Views through
    ``Tensor.numpy()`` or framing by torch ops add 10 to 40."""
    cases = [(name, "allgather") for name in ("terngrad", "qsgd-inf", "ef-sign")]
    added = run_parallel(_added_per_step, 2, cases + [("ef-sign", "sharded")])[0]
    assert all(ops <= 8 for ops, _ in added.values()), added


@pytest.mark.multiprocess
def test_dense_codecs_read_nothing_from_the_device_in_a_step():
    """A read of a tensor's value into Python (``item``, ``bool``, ``nonzero``) makes the
    host wait for a GPU. The dense codecs' steps make none on the eager path, which CUDA
    tensors take (with error feedback, worker momentum and PowerSGD's factors committed by
    the step's finiteness as a tensor), nor with the CPU kernels."""
    cases = [
        ("terngrad", "allgather"),
        ("qsgd-inf", "allreduce"),
        ("nuqsgd", "sharded"),
        ("ef-sign", "auto"),
        ("ef-sign", "sharded"),
        ("fp16", "auto"),
        ("powersgd", "auto"),
    ]
    for kernels in (False, True):
        added = run_parallel(_added_per_step, 2, cases, kernels)[0]
        reads = {case: reads for case, (_, reads) in added.items()}
        assert not any(reads.values()), (kernels, reads)


@pytest.mark.parametrize(
    "shape, dtype",
    [(7, np.uint8), (np.int64(5), np.float32), ((3, 5), np.float32), ((0,), np.float64)],
)
def test_kernel_outputs_are_aligned_for_tensorflow(shape, dtype):
    """``hvd_compress.fused.empty``, which every kernel's output comes from: aligned to
    ``ALIGNMENT`` bytes (TensorFlow adopts a ``tf.numpy_function``'s result without a copy
    only then), C-contiguous and writable, of the shape and dtype asked for."""
    from hvd_compress import fused as core

    for _ in range(8):  # numpy's own allocations fall on 16-byte boundaries
        array = core.empty(shape, dtype)
        assert array.ctypes.data % core.ALIGNMENT == 0
        assert array.shape == ((int(shape),) if np.ndim(shape) == 0 else tuple(shape))
        assert array.dtype == dtype
        assert array.flags.c_contiguous and array.flags.writeable
