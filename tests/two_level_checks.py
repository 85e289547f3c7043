"""The two-level exchange's cases and checks that both ports' multi-process tests share
(``test_two_level``, ``test_tf_two_level``): every rank's parameters identical, each step's
averaged gradient the numpy reference's (``simulate.two_level_step``), the bytes handed as
the cost model predicts."""

import numpy as np

import hvd_compress
from hvd_compress import cost, seeding, simulate
from hvd_compress.seeding import stream_seed

from .pt_jobs import TERNGRAD

# (codec, error_feedback, whether the reference covers it): ef-sign's two-way server has
# no reference in ``simulate``; its ranks must still agree.
CONFIGS = [
    (hvd_compress.TernGrad(**TERNGRAD), None, True),
    (hvd_compress.QSGDInf(bits=4, bucket_size=512, min_size=1000), None, True),
    (hvd_compress.BlockSign(min_size=1000), None, False),
]


def by_reduce_scatter(port, body, *args, **kwargs):
    """``body`` run with every node averaging by a reduce-scatter, as nodes of GPUs do,
    where CPU tensors average by an allreduce (``topology.averages_by_allreduce``, as
    ``port``'s ``TwoLevelSteps._join_nodes`` calls it)."""
    from unittest import mock

    caller = f"hvd_compress.{port}.two_level"
    with mock.patch(f"{caller}.averages_by_allreduce", return_value=False):
        return body(*args, **kwargs)


def check(results, codec, nodes, reference, allreduce_dtypes=cost.TORCH_ALLREDUCE_DTYPES):
    """Every rank's parameters equal at every step, the bytes handed the cost model's, and
    with a ``reference`` each exchanged gradient ``simulate.two_level_step``'s, among the
    nodes by the exchange ``cost.two_level_inner`` chooses for the port's
    ``allreduce_dtypes``. Records hold each tensor's local and exchanged gradients by name,
    as arrays or CPU tensors."""
    world = len(results)
    for step in range(len(results[0]["records"])):
        first = results[0]["records"][step]
        for other in results[1:]:
            record = other["records"][step]
            assert np.array_equal(record["params"], first["params"]), f"step {step}"
        for r in results:
            assert r["records"][step]["bytes"] == r["expected_bytes"]
        if not reference:
            continue
        for index, (name, numel, route, reason) in enumerate(results[0]["tensors"]):
            grads = [np.asarray(r["records"][step]["local"][name]) for r in results]
            got = np.asarray(first["exchanged"][name])
            if reason != "compressed":
                want = np.sum(np.stack(grads), axis=0) / world
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)
                continue
            assert route == cost.TWO_LEVEL
            length = nodes.shard_length(numel)
            uniforms = [
                seeding.uniforms(stream_seed(0, rank, step, index), length) for rank in range(world)
            ]
            inner = cost.two_level_inner(codec, length, nodes.cross_size, allreduce_dtypes)
            want = simulate.two_level_step(codec, grads, nodes, uniforms, inner)
            # A node sums its L ranks' gradients in Horovod's order (a ring's, where it
            # averages by an allreduce), not the reference's: rounding apart, as whole
            # tensors are; a wrong code would be off by a scale over N.
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)
