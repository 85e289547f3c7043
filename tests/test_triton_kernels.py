"""The Triton kernels (``hvd_compress.pt.triton_fused``, what CUDA tensors of the quantizers
run) against the eager ops that define each codec: the same packed bytes, values, residuals
and decoded sums, bit for bit. On a machine without a GPU they run under Triton's
interpreter on CPU tensors (``conftest`` turns it on); with one, compiled on CUDA tensors.
A last test compiles every kernel to cubins for sm_80 and sm_90, which needs no GPU."""

import os
import subprocess
import sys

import pytest
import torch

from hvd_compress.codes import SignCodes, shard_length
from hvd_compress.pt import CODECS, seeding
from hvd_compress.pt.packing import pack, unpack
from hvd_compress.registry import resolve

from .devices import DEVICES

triton_fused = pytest.importorskip("hvd_compress.pt.triton_fused")
pytest.importorskip("triton")

# Every quantizer with fixed-width codes, at each code width (2, 4 and 8 bits), with
# buckets that end mid-program and one bucket per tensor.
SPECS = (
    "terngrad",
    "qsgd:bits=3:bucket_size=7",
    "qsgd:bits=8:bucket_size=300",
    "qsgd-inf",
    "nuqsgd:bucket_size=1000",
    "nuqsgd:bits=4:bucket_size=7",
)
# One element, an odd few, and more than one program of packed 2-bit codes (4,096).
LENGTHS = (1, 13, 5001)
KEY = 12_345_678_901
# The exchanges whose tensors share gradient buckets; the sharded one sums the codes' values,
# which NUQSGD's are not.
EXCHANGES = ("allgather", "allreduce", "sharded")


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu" and not triton_fused.INTERPRETED:
        pytest.skip("CPU tensors take the Triton kernels under TRITON_INTERPRET=1 only")
    # A GPU's programs, which the interpreter would otherwise make larger: the lengths
    # below then cross the programs' edges.
    monkeypatch.setattr(triton_fused, "_BLOCK", 1024)
    return torch.device(request.param)


def _bits(tensor):
    """Floats as their bit patterns, so that NaNs compare equal and -0 differs from 0."""
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor


def _assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got.cpu()), _bits(want.cpu()))


def _gradient(numel, device):
    """Gaussian elements with a NaN, both infinities, a signed zero and a huge value."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    for i, value in zip((3, 5, 7, 9, 11), (float("nan"), float("inf"), -float("inf"), -0.0, 1e30)):
        if i < numel:
            g[i] = value
    return g.to(device)


def _scales(codec, numel, device):
    """Positive scales of every bucket, with a zero, an infinite and a NaN one among them
    where there are buckets enough: the kernels meet what ``local_scale`` can give."""
    buckets = codec.buckets(numel)
    scale = torch.rand(buckets, generator=torch.Generator().manual_seed(buckets)) * 4 + 0.1
    for b, value in zip((1, 2, 3), (0.0, float("inf"), float("nan"))):
        if b < buckets:
            scale[b] = value
    return scale.to(device)


def _fields(space, rows, numel, device, seed=0):
    """``rows`` rows of ``numel`` random codes of ``space``, packed."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-space.bound, space.bound + 1, (rows, numel), generator=generator)
    return pack(codes.to(torch.int32), space).to(device)


# Triton's interpreter divides infinities by infinities with numpy, which warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("spec", SPECS)
def test_encoding_is_the_eager_encoding(spec, numel, device):
    codec = resolve(spec, CODECS)
    p, scale = _gradient(numel, device), _scales(codec, numel, device)
    codes = codec.encode(p, scale, seeding.uniforms(KEY, numel, device))
    values = codec.values(codes)
    space = codec.code_space
    # Packed as the allgather sends them, and as the sharded exchange's padded payload
    # (three more bytes, each the code 0 in every field).
    for extra in (0, 3):
        padded = codes.new_zeros(numel + extra * space.codes_per_byte)
        padded[:numel] = codes
        payload = torch.empty(space.packed_nbytes(padded.numel()), dtype=torch.uint8, device=device)
        residual = torch.empty_like(p)
        triton_fused.encode(codec, payload, p, scale, KEY, residual)
        _assert_same(payload, pack(padded.reshape(1, -1), space).reshape(-1))
        _assert_same(residual, p - codec.decode(values, scale, 1))
    # As the allreduce sends them: the values in its carrier.
    for carrier in (torch.int8, torch.int32, torch.float16, torch.float32):
        payload = torch.empty(numel, dtype=carrier, device=device)
        triton_fused.encode(codec, payload, p, scale, KEY, None)
        _assert_same(payload, values.to(carrier))


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("spec", SPECS)
def test_decodings_are_the_eager_decodings(spec, numel, device):
    codec = resolve(spec, CODECS)
    space, scale = codec.code_space, _scales(codec, numel, device)
    rows = _fields(space, 3, numel, device)
    values = codec.values(unpack(rows, space, numel))
    for count in (1, 3):
        # The allreduce's sum of values, in an integer and a float carrier.
        total = values[:count].to(torch.int32).sum(dim=0)
        for carrier in (torch.int32, torch.float16):
            got = triton_fused.decoded_totals(codec, total.to(carrier), scale, count)
            _assert_same(got, codec.decode(total, scale, count))
        # The allgather's: under one shared scale, and under each worker's own.
        got = triton_fused.decoded_sums(codec, rows[:count], scale, count, numel)
        _assert_same(got, codec.decode(total, scale, count))
        own = torch.stack([_scales(codec, numel, device).roll(r) for r in range(count)])
        messages = torch.cat([own.view(torch.uint8), rows[:count]], dim=1)
        got = triton_fused.decoded_own_scales(codec, messages, own.shape[1] * 4, count, numel)
        want = codec.decode(values[0], own[0], count)
        for r in range(1, count):
            want = want + codec.decode(values[r], own[r], count)
        _assert_same(got, want)


def _bucket(codec, exchange, device, world=2, rank=0):
    """A gradient bucket of tensors of odd lengths, one of them a single element, among
    ``world`` ranks as ``rank`` lays it out, and their gradients and scales, each tensor's
    its own."""
    from hvd_compress.bucketing import gradient_buckets
    from hvd_compress.plan import plan_tensor
    from hvd_compress.pt.bucketing import BucketLayout

    plans = [
        plan_tensor(codec, f"t{i}", i, (n,), True, exchange, False)
        for i, n in enumerate((13, 1, 5001, 15))
    ]
    [bucket] = gradient_buckets(plans, codec, world)
    layout = BucketLayout(bucket, codec, device, rank)
    grads = [_gradient(m.plan.numel, device) for m in bucket.members]
    scales = [_scales(codec, m.plan.numel, device) for m in bucket.members]
    for member, grad in zip(bucket.members, grads):
        layout.put(bucket.members.index(member), grad)
    return layout, grads, scales


def _placed(parts, members, numel):
    """The members' ``parts`` at their offsets in a vector of ``numel`` zeros."""
    vector = parts[0].new_zeros(numel)
    for member, part in zip(members, parts):
        vector[member.offset : member.stop] = part
    return vector


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("spec", SPECS)
def test_a_bucket_codes_and_decodes_as_its_tensors_alone(spec, device):
    """A gradient bucket's encoding (packed as the allgather sends it, and as the sharded
    exchange does, padded to whole shards; as the allreduce's values) and each exchange's
    decoding are its members', each coded alone by the eager ops with its own scales and
    stream, side by side, and zeros in the padding."""
    codec = resolve(f"{spec}:min_size=1", CODECS)
    space, world = codec.code_space, 3
    keys = [KEY + i for i in range(4)]
    exchanges = ("allgather", "allreduce") if spec.startswith("nuqsgd") else EXCHANGES
    for exchange in exchanges:
        layout, grads, scales = _bucket(codec, exchange, device)
        members, words, numel = layout.bucket.members, layout.words(keys), layout.bucket.numel
        alone = [
            codec.encode(g, s, seeding.uniforms(k, g.numel(), device))
            for g, s, k in zip(grads, scales, keys)
        ]
        values = [codec.values(c) for c in alone]
        scale = torch.cat(scales)
        residual = torch.empty_like(layout.vector)
        if exchange == "allreduce":
            payload = torch.empty(numel, dtype=torch.int8, device=device)
            want = torch.cat(values).to(torch.int8)
        else:
            total_space = codec.value_space.summed(world)
            padded = (
                numel
                if exchange == "allgather"
                else world * shard_length(numel, world, space, total_space)
            )
            nbytes = space.packed_nbytes(padded)
            payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
            want = pack(_placed(alone, members, padded).reshape(1, -1), space).reshape(-1)
        triton_fused.encode(layout.codec, payload, layout.vector, scale, words, residual)
        _assert_same(payload, want)
        for m, g, v, s in zip(members, grads, values, scales):
            _assert_same(residual[m.offset : m.stop], g - codec.decode(v, s, 1))
        # Decoded: the allreduce's totals, the sharded exchange's summed shards, the
        # allgather's rows under own scales.
        if exchange != "allgather":
            want = [
                codec.decode(v.to(torch.int32) * world, s, world) for v, s in zip(values, scales)
            ]
        if exchange == "allreduce":
            got = triton_fused.decoded_totals(
                layout.codec, payload.to(torch.int32) * world, scale, world
            )
        elif exchange == "sharded":
            totals = _placed([v.to(torch.int32) * world for v in values], members, padded)
            rows = pack(totals.reshape(world, -1), total_space)
            length = padded // world
            got = triton_fused.decoded_segments(
                layout.codec, rows, total_space, length, scale, world, numel
            )
        else:
            own = torch.stack([scale.roll(r) for r in range(world)])
            messages = torch.cat([own.view(torch.uint8), payload.expand(world, -1)], dim=1)
            got = triton_fused.decoded_own_scales(
                layout.codec, messages, own.shape[1] * 4, world, numel
            )
            want, first = [], 0
            for v, s in zip(values, scales):
                blocks = slice(first, first + s.numel())
                first = blocks.stop
                decoded = codec.decode(v, own[0, blocks], world)
                for r in range(1, world):
                    decoded = decoded + codec.decode(v, own[r, blocks], world)
                want.append(decoded)
        for m, w in zip(members, want):
            _assert_same(got[m.offset : m.stop], w)
        padding = ~_placed(
            [torch.ones(m.plan.numel, dtype=torch.bool) for m in members], members, numel
        )
        assert torch.equal(got.cpu()[padding], torch.zeros(int(padding.sum())))


def _sign_rows(world, numel, device):
    """``world`` rows of ``numel`` random signs, packed."""
    generator = torch.Generator().manual_seed(numel + world)
    signs = torch.randint(0, 2, (world, numel), generator=generator, dtype=torch.int8) * 2 - 1
    return pack(signs, SignCodes()).to(device)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("spec", ["ef-sign", "ef-sign:max_block_size=7"])
@pytest.mark.parametrize("exchange", ["allgather", "sharded"])
def test_ef_sign_buckets_code_and_serve_as_the_eager_ops(spec, exchange, device, monkeypatch):
    """ef-sign's gradient buckets: the worker's packed signs and residual, a server's
    average, residual, codes or decode (the allgather's replicated server; rank 1's shard
    of a bucket sharded member by member), and the decode of every server's message,
    against the eager ops, with the residual lr_ratio a number and a tensor."""
    from hvd_compress.pt.exchange import Allgather, Meter
    from hvd_compress.pt.memory import ErrorFeedback
    from hvd_compress.server import ServerStep

    monkeypatch.setattr(triton_fused, "ON_CPU", True)  # the exchange's kernels on CPU too
    codec, world = resolve(f"{spec}:min_size=1", CODECS), 3
    layout, _, _ = _bucket(codec, exchange, device, world, rank=1)
    bucket, blocked, p = layout.bucket, layout.codec, layout.vector
    scale = blocked.local_scale(p)
    packed, residual, _ = triton_fused.signs(blocked, p, scale)
    codes = blocked.encode(p, scale, None)
    _assert_same(packed, pack(codes.reshape(1, -1), SignCodes()).reshape(-1))
    _assert_same(residual, p - blocked.decode(blocked.values(codes), scale, 1))
    shards = layout.shards
    length = bucket.numel if shards is None else shards.length
    bits = _sign_rows(world, length, device)
    own = torch.stack([scale.roll(r) * (r + 1) for r in range(world)])
    # A server residual, zero in the padding, as the pipeline keeps it.
    kept = torch.randn(length, generator=torch.Generator().manual_seed(length)).to(device)
    if shards is None:
        members = [torch.ones(m.plan.numel, dtype=torch.bool) for m in bucket.members]
        kept *= _placed(members, bucket.members, length).to(device)
    else:
        kept *= shards.worker_blocks >= 0
    for lr_ratio in (0.5, torch.tensor(0.25, dtype=torch.float64, device=device)):
        memories = ErrorFeedback(), ErrorFeedback()
        for memory in memories:
            memory.residuals["b"] = kept
        device_step, eager_step = (ServerStep(m, "b", lr_ratio) for m in memories)
        if shards is None:
            messages = torch.cat([own.view(torch.uint8), bits], dim=1)
            got = Allgather(blocked, length, world, Meter(), world, device_step)._serve(
                messages, scale
            )
            with monkeypatch.context() as eager:
                eager.setattr(triton_fused, "ENABLED", False)
                exchange = Allgather(blocked, length, world, Meter(), world, eager_step)
                want = exchange._serve(messages, scale)
            _assert_same(got, want)
            assert got.data_ptr() == blocked.bucket_length(length).decoded.data_ptr()
        else:
            got, got_scale = triton_fused.server_step(
                device_step,
                shards.server_codec,
                bits,
                own,
                world,
                length,
                blocks=shards.worker_blocks,
            )
            signs = unpack(bits, SignCodes(), length)
            average = shards.worker_average(signs, own, world)
            codes, want_scale, _ = eager_step(shards.server_codec, average)
            _assert_same(got_scale, want_scale)
            _assert_same(got, pack(codes.reshape(1, -1), SignCodes()).reshape(-1))
        _assert_same(memories[0].proposed["b"], memories[1].proposed["b"])
    if shards is not None:  # every server's message decoded into the bucket
        heads = torch.rand(world, shards.head, generator=torch.Generator().manual_seed(7))
        heads[0, 0], heads[1, -1] = float("inf"), float("nan")
        heads = heads.to(device)
        # Signs +1 (bits 0) in the padding, as the servers pack them.
        signs = unpack(bits, SignCodes(), length).reshape(-1)
        signs[shards.server_blocks < 0] = 1
        bits = pack(signs.reshape(world, length), SignCodes())
        got = triton_fused.decoded_shards(
            blocked,
            bits,
            heads.reshape(-1),
            shards.server_blocks,
            shards.order,
            length,
            bucket.numel,
        )
        _assert_same(got, shards.decoded(unpack(bits, SignCodes(), length), heads))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("spec", [s for s in SPECS if not s.startswith("nuqsgd")])
def test_sharded_sums_are_the_eager_sums(spec, numel, world, device):
    codec = resolve(spec, CODECS)
    space, total_space = codec.code_space, codec.value_space.summed(world)
    length = shard_length(numel, world, space, total_space)
    received = _fields(space, world, length, device, seed=world)
    summed = triton_fused.summed_codes(codec, received, length, total_space)
    sums = codec.values(unpack(received, space, length)).to(torch.int32).sum(dim=0)
    _assert_same(summed, pack(sums.reshape(1, -1), total_space).reshape(-1))
    # Every shard's sum, as the allgather returns them, decoded.
    gathered = torch.stack([summed.roll(r) for r in range(world)])
    scale = _scales(codec, numel, device)
    got = triton_fused.decoded_segments(codec, gathered, total_space, length, scale, world, numel)
    total = unpack(gathered, total_space, length).reshape(-1)[:numel]
    _assert_same(got, codec.decode(total, scale, world))


def test_half_precision_gradients_keep_the_eager_ops(device):
    codec = resolve("terngrad", CODECS)
    if device.type == "cpu" and not triton_fused.ON_CPU:
        pytest.skip("CPU tensors take the Triton kernels with HVD_COMPRESS_KERNELS=triton")
    assert triton_fused.applies(codec, torch.zeros(3, device=device))
    for dtype in (torch.float16, torch.bfloat16):
        assert not triton_fused.applies(codec, torch.zeros(3, dtype=dtype, device=device))
    # ef-sign's kernels take gradient buckets only.
    assert not triton_fused.applies(resolve("ef-sign", CODECS), torch.zeros(3, device=device))
    assert not triton_fused.signs_apply(resolve("ef-sign", CODECS), torch.zeros(3, device=device))


# Every kernel, in each of its specializations that differ in code: each rounding mode,
# packed at each width and as values, decoding each width under own and shared scales, for
# a tensor and (SEGMENTED) for a gradient bucket; ef-sign's signs, server averages and
# decode of a bucket's shards.
_COMPILE = r"""
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from hvd_compress.pt import triton_fused, triton_kernels as k

# Each argument's type where a kernel is called: pointers by name, the float scalars, the
# stream's 64-bit words, and 32-bit integers for the rest.
TYPES = {"p": "*fp32", "scale": "*fp32", "residual": "*fp32", "total": "*i32",
         "scales": "*fp32", "rows": "*u8", "out": "*u8", "levels": "fp32", "divisor": "fp32",
         "lo": "i64", "multiplier": "i64", "table": "*i64", "members": "*i64", "words": "*i64",
         "decoded": "*fp32", "heads": "*fp32", "blocks": "*i32", "order": "*i32",
         "lr_ratio": "fp32"}
# A tensor's kernels take no program tables.
ALONE = dict(SEGMENTED=False, table=None, members=None)
# Kernels whose ``out`` is float32, and the quantizer's when it writes values.
FLOAT_OUT = (k.decode_totals, k.decode_rows, k.decode_segments, k.average_signs, k.decode_shards)
CASES = [
    (k.quantize, dict(MODE=k.ONE_LEVEL, WIDTH=2, PACKED=True, FEEDBACK=True, **ALONE, words=None)),
    (k.quantize, dict(MODE=k.UNIFORM, WIDTH=4, PACKED=True, FEEDBACK=False, **ALONE, words=None)),
    (k.quantize, dict(MODE=k.NUQSGD, WIDTH=8, PACKED=False, FEEDBACK=True, **ALONE, words=None)),
    (k.decode_totals, ALONE),
    (k.decode_rows, dict(WIDTH=2, NUQSGD=False, OWN_SCALES=True, **ALONE)),
    (k.decode_rows, dict(WIDTH=4, NUQSGD=True, OWN_SCALES=False, **ALONE)),
    (k.sum_codes, dict(WIDTH=2, TOTAL_WIDTH=4, NUQSGD=False)),
    (k.decode_segments, dict(WIDTH=16, **ALONE)),
    (k.quantize, dict(MODE=k.UNIFORM, WIDTH=2, PACKED=True, FEEDBACK=True, SEGMENTED=True)),
    (k.quantize, dict(MODE=k.NUQSGD, WIDTH=8, PACKED=False, FEEDBACK=False, SEGMENTED=True)),
    (k.decode_totals, dict(SEGMENTED=True)),
    (k.decode_rows, dict(WIDTH=4, NUQSGD=True, OWN_SCALES=True, SEGMENTED=True)),
    (k.decode_segments, dict(WIDTH=4, SEGMENTED=True)),
    (k.signs, dict(PACKED=True, FEEDBACK=True, DECODED=False, SEGMENTED=True)),
    (k.signs, dict(PACKED=False, FEEDBACK=True, DECODED=True, SEGMENTED=True)),
    (k.average_signs, dict(BLOCK_INDEX=False, FEEDBACK=True, SEGMENTED=True)),
    (k.average_signs, dict(BLOCK_INDEX=True, FEEDBACK=False, **ALONE)),
    (k.decode_shards, {}),
]
for capability in map(int, sys.argv[1:]):
    for kernel, constants in CASES:
        constants = dict(constants, BLOCK=1024)
        signature = {
            name: "constexpr" if name in constants else TYPES.get(name, "i32")
            for name in kernel.arg_names
        }
        if kernel in FLOAT_OUT:
            signature["out"] = "*fp32"
        elif not constants.get("PACKED", True):
            signature["out"] = "*i32"
        compiled = compile(
            ASTSource(kernel, signature, constants),
            target=GPUTarget("cuda", capability, 32),
            options=triton_fused._COMPILE_OPTIONS,
        )
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"], kernel
        # Products and sums round apart, divisions round to nearest, as the eager ops do.
        assert "fma.rn.f32" not in ptx and "div.full" not in ptx and "div.approx" not in ptx
        print(capability, kernel.fn.__name__, len(compiled.asm["cubin"]))
"""


def test_every_kernel_compiles_for_sm80_and_sm90():
    # A process of its own: under the interpreter, ``triton.jit`` gives no compilable kernel.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, "80", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.stdout.splitlines()) == 36, run.stdout


def _device_and_eager_steps(cases, steps=2):
    """For each (codec, exchange, error feedback) of ``cases``: whether a few steps of
    ``Net`` on the device path (Triton's kernels, interpreted on CPU tensors) leave every
    parameter bitwise equal to the eager path's, the kernels it launched in the last step,
    and the reads of tensor values into Python that step added over ``none``'s."""
    import horovod.torch as hvd
    from torch.profiler import ProfilerActivity, profile

    import hvd_compress.pt as hc
    from benchmarks.op_count import host_reads
    from hvd_compress.pt import fused

    from .pt_jobs import Net

    hvd.init()

    def train(codec, exchange, feedback):
        torch.manual_seed(0)
        model = Net()
        optimizer = hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model.named_parameters(),
            compression=codec,
            exchange=exchange,
            error_feedback=feedback,
        )
        data = torch.Generator().manual_seed(hvd.rank())

        def step():
            x, y = torch.randn(16, 64, generator=data), torch.randint(0, 10, (16,), generator=data)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        for _ in range(steps - 1):
            step()
        # The whole step: the hooks encode a tensor during the backward pass when its
        # scale arrives in time, and step() the others.
        launched = triton_fused.launches
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step()
        parameters = [p.detach().clone() for p in model.parameters()]
        return parameters, triton_fused.launches - launched, host_reads(profiler.events())

    on_cpu, enabled = triton_fused.ON_CPU, fused.ENABLED
    results = {}
    try:
        triton_fused.ON_CPU = True
        _, _, baseline_reads = train("none", "auto", None)
        for codec, exchange, feedback in cases:
            triton_fused.ON_CPU = True
            device, launched, reads = train(f"{codec}:min_size=100", exchange, feedback)
            triton_fused.ON_CPU, fused.ENABLED = False, False
            eager, _, _ = train(f"{codec}:min_size=100", exchange, feedback)
            fused.ENABLED = enabled
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(device, eager))
            results[codec, exchange] = (same, launched, reads - baseline_reads)
    finally:
        triton_fused.ON_CPU, fused.ENABLED = on_cpu, enabled
    return results


@pytest.mark.multiprocess
def test_the_device_path_trains_as_the_eager_ops():
    """The step with Triton's kernels (each exchange, with and without error feedback) gives
    the eager ops' parameters bit for bit at N = 2, launches kernels rather than falling back
    to the eager ops, and reads nothing from the device into Python."""
    from .harness import run_parallel

    if not triton_fused.INTERPRETED:
        pytest.skip("CPU tensors take the Triton kernels under TRITON_INTERPRET=1 only")
    cases = [
        ("terngrad", "allgather", True),
        ("qsgd-inf", "allgather", None),
        ("nuqsgd", "allreduce", True),
        ("qsgd", "sharded", None),
        ("ef-sign", "allgather", None),
        ("ef-sign", "sharded", None),
    ]
    results = run_parallel(_device_and_eager_steps, 2, cases)
    assert results[0] == results[1]
    for case, (same, launched, reads) in results[0].items():
        # An encoding and a decode at least: a bucket of both compressed tensors, or each.
        assert same and launched >= 2 and reads == 0, (case, same, launched, reads)


def test_the_device_path_on_cpu_needs_the_interpreter():
    """``HVD_COMPRESS_KERNELS=triton`` without ``TRITON_INTERPRET=1`` would hand CPU tensors
    to compiled kernels: the import refuses it, naming both settings."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HVD_COMPRESS_KERNELS"] = "triton"
    run = subprocess.run(
        [sys.executable, "-c", "import hvd_compress.pt"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "HVD_COMPRESS_KERNELS=triton" in run.stderr and "TRITON_INTERPRET=1" in run.stderr
