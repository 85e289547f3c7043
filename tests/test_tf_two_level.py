"""The TensorFlow port's two-level exchange (``exchange="two-level"``) on M nodes of L ranks,
placed on named hosts of this machine as ``horovodrun -H`` places them (``tests.nodes``):
every rank's weights identical, each step's averaged gradient the numpy reference's
(``simulate.two_level_step``), the bytes handed as ``cost.two_level_traffic`` predicts.

Every TensorFlow body runs in the child processes only (see ``test_tf_codecs``)."""

import pytest

from hvd_compress import cost
from hvd_compress.topology import Nodes

from . import process_sets
from .harness import run_parallel
from .tf_jobs import tape_loop
from .two_level_checks import CONFIGS, by_reduce_scatter, check

pytestmark = pytest.mark.multiprocess


def _tape_loop_both_ways(configs, reduce_scattered, **options):
    """``_tape_loop`` of ``configs``, then of ``reduce_scattered`` with each node averaging
    by a reduce-scatter."""
    return tape_loop(configs, **options) + by_reduce_scatter(
        "tf", tape_loop, reduce_scattered, **options
    )


def _by_name(run):
    """A run of ``tf_jobs.tape_loop`` with each step's local and exchanged
    gradients by tensor name, as ``two_level_checks.check`` reads them."""
    names = [name for name, *_ in run["tensors"]]
    for record in run["records"]:
        for key in ("local", "exchanged"):
            record[key] = dict(zip(names, record[key]))
    return run


# The degenerate layouts on 2 ranks, where they take the same paths as on 4 (PyTorch's
# test runs them on 4): each rank traces every configuration, slowly on 2 cores.
@pytest.mark.parametrize("layout", ["2x2", "1x2", "2x1"])
def test_two_level_exchange_is_the_reference_on_every_rank(layout):
    """2 x 2 compresses between the nodes only; 1 x 2 (one node) reduces to an
    uncompressed average and allgather, 2 x 1 to the codec's flat exchange. On 2 x 2,
    TernGrad runs again with the node's average by a reduce-scatter."""
    count, local = map(int, layout.split("x"))
    nodes = Nodes(tuple(tuple(range(m * local, (m + 1) * local)) for m in range(count)))
    configs = [(codec, "two-level", True) for codec, _, _ in CONFIGS]
    again = CONFIGS[:1] if layout == "2x2" else []
    per_rank = run_parallel(
        _tape_loop_both_ways,
        count * local,
        configs,
        configs[: len(again)],
        layout=process_sets.DYNAMIC,
        launcher=layout,
    )
    for (codec, _, reference), results in zip(CONFIGS + again, zip(*per_rank)):
        runs = [_by_name(run) for run in results]
        check(runs, codec, nodes, reference, cost.TF_ALLREDUCE_DTYPES)
