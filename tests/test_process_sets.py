"""Process sets: each data-parallel group of a 4-rank job averages among itself, in both
ports.

Two layouts (``tests.process_sets``), one after the other in one job per port: two sets of
two ranks, and one set of three with rank 3 outside. In each, a summable codec (TernGrad
over the sharded exchange), the two-way ef-sign and the sparse CLT-k train; the ranks of a
set must agree bitwise and match the reference computed from the set's gradients alone, the
two sets of a layout must differ, and a rank outside every set must step on its own
gradients, exchanging nothing.
"""

import numpy as np
import pytest
import torch

import hvd_compress

from . import process_sets
from .harness import run_parallel
from .pt_jobs import (
    TERNGRAD,
    check_consistent_and_exact,
    replay_clt_k,
    train,
    train_ef,
    train_sparse,
    virtual_iterate_gap,
)
from .tf_jobs import (
    assert_sparse_ranks_agree,
    check_clt_k,
    check_tape_loop,
    check_tape_sources,
    check_tape_sources_outside,
    sparse_tape_loop,
    tape_loop,
    tape_sources,
)

pytestmark = pytest.mark.multiprocess

CLT_K = hvd_compress.CyclicLocalTopK(ratio=10, beta=0.5, min_size=0)
LAYOUTS = {"pairs": process_sets.PAIRS, "three": process_sets.THREE}
TF_CONFIGS = [
    (hvd_compress.TernGrad(min_size=1000, compress_classifier=False), "sharded", True),
    (hvd_compress.BlockSign(min_size=0), "allgather", True),
    (hvd_compress.BlockSign(max_block_size=300, min_size=0), "sharded", True),
]


def _pt_job():
    """TernGrad, ef-sign and CLT-k in this rank's set of each layout."""
    import horovod.torch as hvd

    results = {
        layout: {
            "terngrad": train(hvd_compress.TernGrad(**TERNGRAD), "sharded", layout=sets),
            "ef-sign": train_ef("sharded", steps=6, drop_at=3, layout=sets),
            "clt-k": train_sparse(CLT_K, steps=4, layout=sets),
        }
        for layout, sets in LAYOUTS.items()
    }
    # A rank that leaves shuts Horovod down for everyone: wait until every set is done.
    hvd.allreduce(torch.zeros(1), name="test.end")
    return results


def _tf_job():
    """TernGrad, ef-sign (replicated and sharded server) and CLT-k through the tape, and the
    tape's watched tensors and local sources, in this rank's set of each layout."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    results = {}
    for layout, sets in LAYOUTS.items():
        runs = tape_loop(TF_CONFIGS, layout=sets)
        results[layout] = {
            "runs": runs,
            "clt-k": sparse_tape_loop(CLT_K, 4, True, layout=sets),
            "sources": tape_sources(layout=sets),
        }
    hvd.allreduce(tf.zeros(1), name="test.end")
    return results


def _check_pt_set(results):
    """The PyTorch ranks of one set (in set order) agree and match the reference of their
    own gradients."""
    check_consistent_and_exact([r["terngrad"] for r in results], hvd_compress.TernGrad(**TERNGRAD))
    ef = [r["ef-sign"] for r in results]
    for step in range(len(ef[0]["params"])):
        for other in ef[1:]:
            assert torch.equal(other["params"][step], ef[0]["params"][step]), step
    assert virtual_iterate_gap(ef, "sharded") < 1e-5
    for r in ef:
        assert all(handed == r["expected"] for handed in r["handed"])
    replay_clt_k([r["clt-k"] for r in results], CLT_K)


def _check_tf_set(results):
    """The same for the TensorFlow ranks of one set."""
    for index, (codec, exchange, _) in enumerate(TF_CONFIGS):
        check_tape_loop(codec, exchange, [r["runs"][index] for r in results])
    sparse = [r["clt-k"] for r in results]
    assert_sparse_ranks_agree(sparse)
    check_clt_k(sparse)
    check_tape_sources([r["sources"] for r in results])


def _pt_outside(result):
    """What a PyTorch rank outside its set stepped on: its own gradients."""
    for record in result["terngrad"]["records"] + result["clt-k"]["records"]:
        assert record["bytes"] == 0
        for name, grad in record["exchanged"].items():
            assert torch.equal(grad, record["local"][name]), name
    assert all(handed == 0 for handed in result["ef-sign"]["handed"])


def _tf_outside(result):
    for record in [rec for run in result["runs"] for rec in run["records"]]:
        assert record["bytes"] == 0
        for got, local in zip(record["exchanged"], record["local"]):
            np.testing.assert_array_equal(got, local)
    for record in result["clt-k"]["records"]:
        assert record["bytes"] == 0
        for name, grad in record["exchanged"].items():
            np.testing.assert_array_equal(grad, record["local"][name])
    check_tape_sources_outside(result["sources"])


def _last_params(result, port):
    if port == "pytorch":
        return [result[c]["records"][-1]["params"].numpy() for c in ("terngrad", "clt-k")]
    runs = result["runs"] + [result["clt-k"]]
    return [run["records"][-1]["params"] for run in runs]


PORTS = {
    "pytorch": (_pt_job, _check_pt_set, _pt_outside),
    "tensorflow": (_tf_job, _check_tf_set, _tf_outside),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("port", sorted(PORTS))
def test_sets_average_among_themselves(port):
    job, check_set, check_outside = PORTS[port]
    results = run_parallel(job, 4, timeout=800, own_job=True)
    for layout, sets in LAYOUTS.items():
        by_rank = [r[layout] for r in results]
        for ranks in sets:
            check_set(process_sets.members(by_rank, ranks))
    # The two groups of a pair saw different data, so they trained differently.
    pairs = [_last_params(results[ranks[0]]["pairs"], port) for ranks in LAYOUTS["pairs"]]
    for first, second in zip(*pairs):
        assert not np.array_equal(first, second)
    check_outside(results[3]["three"])
