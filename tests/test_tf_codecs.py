"""The TensorFlow codecs against the numpy reference and the PyTorch port, byte for byte.

TensorFlow runs in a child process (``run_parallel(..., 1)``): this pytest process imports
``horovod.torch``, and the two Horovod extensions must never share a process, so this module
imports neither framework at module level (the child imports it too). One child computes
every case, eagerly and inside ``tf.function``; the comparisons happen here.
"""

import numpy as np
import pytest

import hvd_compress
from hvd_compress import elias, packing
from hvd_compress.codes import IntCodes, SignCodes

from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

CODECS = [
    hvd_compress.NoneCodec(),
    hvd_compress.FP16(),
    hvd_compress.TernGrad(),
    hvd_compress.TernGrad(clip=0),
    hvd_compress.QSGD(),
    hvd_compress.QSGDInf(),
    hvd_compress.QSGD(bits=2, bucket_size=128),
    hvd_compress.NUQSGD(bucket_size=2048),
    hvd_compress.NUQSGD(bits=5, bucket_size=100),
    hvd_compress.NUQSGD(wire="elias"),
    hvd_compress.QSGDInf(bits=2, bucket_size=128, wire="elias"),
    hvd_compress.BlockSign(),
    hvd_compress.BlockSign(max_block_size=100),
]
NUMEL = 10_007
PACKING = [(numel, bound) for numel in (0, 1, 5, 100_003) for bound in (1, 7, 100, 2048, 40000)]
# (seed, rank, tensor index) of streams drawn at step STEP, a tensor in the traced step.
STREAMS = [(0, 0, 0), (0, 3, 75), (-5, 1, 2), (2**40, 2, 9)]
STEP = 10**6 + 3


def _inputs(index):
    rng = np.random.default_rng(index)
    g = rng.standard_normal(NUMEL).astype(np.float32)
    g[::97] = 0  # exact zeros: sign(0), and gaps for the Elias coder
    return g, rng.random(NUMEL).astype(np.float32)


def _scale(codec, g):
    return codec.local_scale(g) if codec.scaled else None


def _tf_cases(codecs, packing_cases):
    """Every codec's local scales, codes, wire bytes, unpacked codes and decoded values in
    TensorFlow, eager and traced, under the reference's scales and uniforms; and packed
    rows of every width."""
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf import elias as tf_elias
    from hvd_compress.tf import packing as tf_packing

    def run(codec, g, scale, u):
        if codec.code_space is None:
            codes, _ = codec.compress(g)
            return {"codes": codes}
        codes = codec.encode(g, scale, u)
        if codec.wire == "elias":
            data = tf_elias.encode(codes)
            unpacked = tf_elias.decode(data, NUMEL)
        else:
            data = tf_packing.pack(codes[None], codec.code_space)
            unpacked = tf_packing.unpack(data, codec.code_space, NUMEL)[0]
            data = tf.reshape(tf.bitcast(data, tf.uint8) if data.dtype != tf.uint8 else data, [-1])
        out = {
            "codes": codes,
            "data": data,
            "unpacked": unpacked,
            "decoded": codec.decode(codec.values(codes)[None] * 2, scale, 2)[0],
        }
        if codec.scaled:
            out["scale"] = codec.local_scale(g)
        return out

    results = {"codecs": [], "packing": [], "errors": [], "uniforms": []}
    misuse = [
        lambda: htf.TernGrad().compress(tf.zeros(3)),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="ef-sign", exchange="allreduce"
        ),
        lambda: htf.DistributedOptimizer(object(), compression="terngrad"),
        lambda: htf.DistributedGradientTape(tf.GradientTape(), compression="top-k"),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="ef-sign", error_feedback=False
        ),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="adacomp", error_feedback=False
        ),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="adacomp", adaptive=True
        ),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="terngrad", exchange="two-level", adaptive=True
        ),
        lambda: htf.DistributedGradientTape(
            tf.GradientTape(), compression="terngrad", adaptive={"warmup_steps": 2}
        ),
    ]
    for call in misuse:
        try:
            call()
        except (TypeError, ValueError) as error:
            results["errors"].append(str(error))
    results["fp16_in_horovods_hook"] = htf.FP16().compress(tf.ones(3))[0].dtype.name
    for index, reference in enumerate(codecs):
        codec = hvd_compress.resolve(reference, htf.CODECS)
        g, u = _inputs(index)
        scale = _scale(reference, g)
        arguments = (tf.constant(g), None if scale is None else tf.constant(scale), tf.constant(u))
        traced = tf.function(lambda *args, codec=codec: run(codec, *args))
        results["codecs"].append(
            {
                mode: {k: v.numpy() for k, v in outputs.items()}
                for mode, outputs in (
                    ("eager", run(codec, *arguments)),
                    ("traced", traced(*arguments)),
                )
            }
        )
    for numel, bound in packing_cases:
        space = IntCodes(bound)
        packed = tf_packing.pack(tf.constant(_rows(numel, bound)), space)
        unpacked = tf_packing.unpack(packed, space, numel)
        results["packing"].append((packed.numpy(), unpacked.numpy()))
    results["packing_graphs"] = {
        str(space): _full_size_integer_ops(tf, tf_packing, space)
        for space in [IntCodes(bound) for _, bound in packing_cases[:5]] + [SignCodes()]
    }
    from hvd_compress.tf.pipeline import uniforms

    for jit_compile in (None, True):
        draw = tf.function(
            lambda step: [
                uniforms(seed, rank, step, index, [97, 103]) for seed, rank, index in STREAMS
            ],
            jit_compile=jit_compile,
        )
        results["uniforms"].append([u.numpy() for u in draw(tf.constant(STEP, tf.int64))])
    return results


def _full_size_integer_ops(tf, tf_packing, space, numel=4096):
    """The (op type, dtype) of every op in the traced ``unpack(pack(codes))`` of two rows of
    ``numel`` codes whose output has a 32- or 64-bit integer type and at least ``numel``
    elements, but for the input and the final int32 codes: full-size passes in the types that
    cost 4-8 bytes per code and that TensorFlow keeps on the host beside a GPU."""
    trip = tf.function(lambda codes: tf_packing.unpack(tf_packing.pack(codes, space), space, numel))
    graph = trip.get_concrete_function(tf.TensorSpec([2, numel], tf.int32)).graph
    found = []
    for op in graph.get_operations():
        if op.type in ("Placeholder", "Identity"):  # the input, and the output returned
            continue
        for output in op.outputs:
            large = output.shape.is_fully_defined() and output.shape.num_elements() >= numel
            if large and output.dtype in (tf.int32, tf.int64):
                found.append((op.type, output.dtype.name))
    return found


def _rows(numel, bound):
    return np.random.default_rng(numel + bound).integers(-bound, bound + 1, (2, numel))


@pytest.fixture(scope="module")
def tf_results():
    return run_parallel(_tf_cases, 1, CODECS, PACKING, timeout=600)[0]


@pytest.mark.parametrize("index", range(len(CODECS)), ids=[repr(c) for c in CODECS])
def test_payload_bytes_equal_numpy_and_pytorch(tf_results, index):
    import torch

    import hvd_compress.pt as hc
    from hvd_compress.pt import elias as pt_elias
    from hvd_compress.pt import packing as pt_packing

    reference = CODECS[index]
    port = hvd_compress.resolve(reference, hc.CODECS)
    g, u = _inputs(index)
    scale = _scale(reference, g)
    for mode, got in tf_results["codecs"][index].items():
        if reference.code_space is None:
            np.testing.assert_array_equal(got["codes"], g)
            continue
        codes = reference.encode(g, scale, u)
        torch_codes = port.encode(
            torch.from_numpy(g),
            None if scale is None else torch.from_numpy(scale),
            torch.from_numpy(u),
        )
        if reference.wire == "elias":
            data, torch_data = elias.encode(codes), pt_elias.encode(torch_codes)
        else:
            data = (
                packing.pack(codes, reference.code_space)
                if reference.scaled or isinstance(reference.code_space, IntCodes)
                else codes
            )
            torch_data = pt_packing.pack(torch_codes, reference.code_space)
        if reference.scaled:
            np.testing.assert_allclose(got["scale"], scale, rtol=1e-6, err_msg=mode)
        np.testing.assert_array_equal(got["codes"], codes, err_msg=mode)
        np.testing.assert_array_equal(torch_codes.numpy(), codes)
        np.testing.assert_array_equal(got["data"], np.asarray(data).view(np.uint8), err_msg=mode)
        np.testing.assert_array_equal(got["data"], torch_data.numpy().view(np.uint8))
        np.testing.assert_array_equal(got["unpacked"], codes, err_msg=mode)
        want = reference.decode(reference.values(codes) * 2, scale, 2)
        np.testing.assert_array_equal(got["decoded"], want, err_msg=mode)


def test_packing_makes_no_full_size_wide_integer_tensors(tf_results):
    for space, found in tf_results["packing_graphs"].items():
        # The one allowed: unpack's int32 codes, its output.
        assert [dtype for _, dtype in found] == ["int32"], (space, found)


@pytest.mark.parametrize("case", range(len(PACKING)), ids=[f"{n}x{b}" for n, b in PACKING])
def test_packing_round_trip_at_every_width(tf_results, case):
    numel, bound = PACKING[case]
    packed, unpacked = tf_results["packing"][case]
    np.testing.assert_array_equal(packed, packing.pack(_rows(numel, bound), IntCodes(bound)))
    np.testing.assert_array_equal(unpacked, _rows(numel, bound))


def test_uniforms_are_the_references_in_graphs_and_xla(tf_results):
    """TensorFlow's draws, traced and compiled by XLA with the step a tensor, are
    ``seeding.uniforms`` of ``stream_seed``: those the PyTorch port draws."""
    from hvd_compress.seeding import stream_seed, uniforms

    for draws in tf_results["uniforms"]:
        for (seed, rank, index), got in zip(STREAMS, draws):
            want = uniforms(stream_seed(seed, rank, STEP, index), 97 * 103)
            np.testing.assert_array_equal(got.reshape(-1), want)


def test_misuse_errors_say_what_to_do(tf_results):
    codes, exchange, optimizer, missing, two_way, sparse, *adaptive = tf_results["errors"]
    assert "cannot run inside Horovod's own DistributedOptimizer" in codes
    assert "hvd_compress.tf.DistributedOptimizer(optimizer, compression='terngrad')" in codes
    assert "ef-sign codes cannot travel by exchange='allreduce'" in exchange
    assert "optimizer must be a keras.optimizers.Optimizer (Keras 3) or a " in optimizer
    assert "tf_keras.optimizers.Optimizer (Keras 2), got object" in optimizer
    assert "compression must be one of" in missing and "got 'top-k'" in missing
    assert "ef-sign compresses on the workers and again on the server" in two_way
    assert "adacomp chooses what to send from its error-feedback memory" in sparse
    assert all("cannot run with error_feedback=False" in e for e in (two_way, sparse))
    selecting, two_level, options = adaptive
    assert "adacomp selects what it sends from its memory" in selecting
    assert "it does not take exchange='two-level'" in two_level
    assert "adaptive must be True, False or an hvd_compress.Adaptive" in options
    assert tf_results["fp16_in_horovods_hook"] == "float16"


def _launched_ops_of_a_known_step():
    """``benchmarks.tf_op_count``'s count of a step whose ops are known: x * 2, a called
    function's sqrt and + 1, x[0] > 0, a conditional with one op in each branch, and an
    XLA-compiled function of three ops."""
    import tensorflow as tf

    from benchmarks.tf_op_count import launched_ops

    @tf.function
    def inner(x):
        return tf.sqrt(x) + 1.0

    @tf.function(jit_compile=True)
    def compiled(x):
        return tf.exp(x) * 2.0 - 1.0

    @tf.function
    def step(x):
        y = inner(x * 2.0)
        return compiled(tf.cond(x[0] > 0, lambda: y * 3.0, lambda: y - 1.0))

    graph = step.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    return dict(launched_ops(graph.as_graph_def())), sorted(
        op.type for op in graph.get_operations() if op.type not in ("Const", "Placeholder")
    )


def test_the_benchmarks_op_count_counts_every_launch_once():
    """Mul, Sqrt, AddV2, StridedSlice, Greater, the conditional itself, both branches'
    ops (Mul, Sub) and the compiled function as one: constants, the arguments and the
    plain function's call launch nothing."""
    launched, top_level = run_parallel(_launched_ops_of_a_known_step, 1)[0]
    assert top_level.count("PartitionedCall") + top_level.count("StatefulPartitionedCall") == 2
    assert launched == {
        "Mul": 2,
        "Sqrt": 1,
        "AddV2": 1,
        "StridedSlice": 1,
        "Greater": 1,
        "StatelessIf": 1,
        "Sub": 1,
        "(XLA cluster)": 1,
    }
