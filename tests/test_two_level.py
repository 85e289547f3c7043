"""The two-level exchange (``exchange="two-level"``) on M nodes of L ranks, placed on named
hosts of this machine as ``horovodrun -H`` places them (``tests.nodes``): every rank's
parameters identical, each step's averaged gradient the numpy reference's
(``simulate.two_level_step``), the bytes handed as ``cost.two_level_traffic`` predicts."""

import numpy as np
import pytest

from hvd_compress.topology import Nodes

from . import process_sets
from .harness import run_parallel
from .pt_jobs import resume, train, train_and_checkpoint
from .two_level_checks import CONFIGS, by_reduce_scatter, check

pytestmark = pytest.mark.multiprocess


def _train_configs(configs):
    return [
        train(codec, "two-level", error_feedback=feedback, layout=process_sets.DYNAMIC)
        for codec, feedback, _ in configs
    ]


def _train_both_ways(configs, reduce_scattered):
    """``_train_configs`` of ``configs``, then of ``reduce_scattered`` by reduce-scatter."""
    return _train_configs(configs) + by_reduce_scatter("pt", _train_configs, reduce_scattered)


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
    uninterrupted = run_parallel(train_and_checkpoint, 4, *args, launcher=layout, **options)
    resumed = run_parallel(resume, 4, *args, launcher=layout, own_job=True, **options)
    for rank in range(4):
        for label, *_ in cases:
            for offset, params in enumerate(resumed[rank][label]):
                assert np.array_equal(params, uninterrupted[rank][label][save_at + offset])


def _without_dynamic_process_sets():
    import horovod.torch as hvd
    import torch

    import hvd_compress.pt as hc

    from .pt_jobs import Net

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
