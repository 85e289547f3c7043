"""The two-level exchange (``exchange="two-level"``) on M nodes of L ranks, placed on named
hosts of this machine as ``horovodrun -H`` places them (``tests.nodes``): every rank's
parameters identical, each step's averaged gradient the numpy reference's
(``simulate.two_level_step``), the bytes handed as ``cost.two_level_traffic`` predicts."""

import numpy as np
import pytest

import hvd_compress
from hvd_compress import cost, seeding, simulate
from hvd_compress.seeding import stream_seed
from hvd_compress.topology import Nodes

from . import process_sets
from .harness import run_parallel
from .test_pt_distributed import TERNGRAD, _train
from .test_state import _resume, _train_and_checkpoint

pytestmark = pytest.mark.multiprocess

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
    ``port``'s pipeline calls it: PyTorch's in its world, ``pt/world.py``)."""
    from unittest import mock

    caller = {"pt": "hvd_compress.pt.world", "tf": "hvd_compress.tf.pipeline"}[port]
    with mock.patch(f"{caller}.averages_by_allreduce", return_value=False):
        return body(*args, **kwargs)


def _train_configs(configs):
    return [
        _train(codec, "two-level", error_feedback=feedback, layout=process_sets.DYNAMIC)
        for codec, feedback, _ in configs
    ]


def _train_both_ways(configs, reduce_scattered):
    """``_train_configs`` of ``configs``, then of ``reduce_scattered`` by reduce-scatter."""
    return _train_configs(configs) + by_reduce_scatter("pt", _train_configs, reduce_scattered)


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


@pytest.mark.parametrize("layout", ["2x2", "1x4", "4x1"])
def test_two_level_exchange_is_the_reference_on_every_rank(layout):
    """2 x 2 compresses between the nodes only; 1 x 4 (one node) reduces to an
    uncompressed average and allgather, 4 x 1 to the codec's flat exchange. Where a node
    has several ranks, TernGrad runs again with the node's average by a reduce-scatter."""
    count, local = map(int, layout.split("x"))
    nodes = Nodes(tuple(tuple(range(m * local, (m + 1) * local)) for m in range(count)))
    again = CONFIGS[:1] if local > 1 else []
    per_rank = run_parallel(_train_both_ways, 4, CONFIGS, again, launcher=layout)
    for (codec, _, reference), results in zip(CONFIGS + again, zip(*per_rank)):
        check(list(results), codec, nodes, reference)


@pytest.mark.parametrize("layout", ["2x2", "4x1"])
def test_two_level_exchange_resumes_bitwise(tmp_path, monkeypatch, layout):
    """Each rank's checkpoint holds the residuals of its shard (and ef-sign's server's, of
    a shard of the shard where the nodes' exchange is sharded, as on 4 x 1): resumed on
    the same nodes, training continues bitwise."""
    # Horovod's fused allreduce of the uncompressed tensors sums 4 ranks' elements in an
    # order that depends on which tensors share its buffer, which varies from run to run;
    # without fusion every run sums alike.
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    cases = [
        ("terngrad+ef", "terngrad", {"min_size": 100}, True),
        ("ef-sign", "ef-sign", {"min_size": 0}, None),
    ]
    steps, save_at = 8, 3
    options = {"cases": cases, "exchange": "two-level", "layout": process_sets.DYNAMIC}
    args = (str(tmp_path), steps, save_at, "cpu")
    uninterrupted = run_parallel(_train_and_checkpoint, 4, *args, launcher=layout, **options)
    resumed = run_parallel(_resume, 4, *args, launcher=layout, own_job=True, **options)
    for rank in range(4):
        for label, *_ in cases:
            for offset, params in enumerate(resumed[rank][label]):
                assert np.array_equal(params, uninterrupted[rank][label][save_at + offset])


def _without_dynamic_process_sets():
    import horovod.torch as hvd
    import torch

    import hvd_compress.pt as hc

    from .test_pt_distributed import Net

    hvd.init()
    model = Net()
    try:
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression="terngrad",
            exchange="two-level",
        )
    except RuntimeError as error:
        return str(error)
    return None


def test_two_level_exchange_says_how_to_initialise_horovod():
    messages = run_parallel(_without_dynamic_process_sets, 4, launcher="2x2", own_job=True)
    assert all("hvd.init(process_sets='dynamic')" in (m or "") for m in messages), messages
