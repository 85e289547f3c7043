"""Each gradient's plan (``hvd_compress.plan``), which both ports build alike."""

import pytest

import hvd_compress
from hvd_compress.accounting import HALF, UNCOMPRESSED
from hvd_compress.plan import plan_tensor


def _plan(shape, floating=True, whole=False, kernels=True, codec=None):
    codec = codec or hvd_compress.TernGrad(min_size=100)
    return plan_tensor(codec, "conv.weight", 3, shape, floating, "allgather", whole, kernels)


def test_a_tensor_the_codec_takes_is_compressed_by_the_exchange():
    plan = _plan((8, 4, 3, 3))
    assert (plan.exchange, plan.reason, plan.numel, plan.index) == (
        "allgather",
        "compressed",
        288,
        3,
    )
    assert (plan.shape, plan.layer, plan.kernels, plan.route) == (
        (8, 4, 3, 3),
        "conv",
        True,
        "allgather",
    )


@pytest.mark.parametrize(
    "shape, floating, whole, reason",
    [
        ((8, 4, 3, 3), True, True, "excluded"),
        ((8, 4, 3, 3), False, False, "not floating point"),
        ((8, 4), True, False, "32 < min_size 100"),
    ],
)
def test_a_tensor_sent_whole_says_why(shape, floating, whole, reason):
    plan = _plan(shape, floating, whole, kernels=False)
    assert (plan.exchange, plan.route, plan.reason, plan.shape) == (
        UNCOMPRESSED,
        UNCOMPRESSED,
        reason,
        (),
    )
    assert plan.kernels is False


def test_a_codec_without_codes_sends_every_tensor_whole():
    plan = _plan((8, 4, 3, 3), codec=hvd_compress.resolve("none"))
    assert (plan.exchange, plan.reason) == (UNCOMPRESSED, "codec none")


def test_a_scalar_has_one_element():
    assert _plan((), whole=True).numel == 1


@pytest.mark.parametrize(
    "path, route", [("codec", "allgather"), ("fp16", HALF), ("fp32", UNCOMPRESSED)]
)
def test_the_route_follows_the_adaptive_path(path, route):
    plan = _plan((8, 4, 3, 3))
    plan.path = path
    assert plan.route == route
