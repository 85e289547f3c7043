"""The main job's claim: on MNIST-1D no run of the demo ends more than 1 point below its
baseline (uncompressed training with the same optimizer, or synchronous clipped SGD for the
GRU) with the same model, workers, seed and steps; every baseline reaches 90%; and every run
hands Horovod at least 5x fewer bytes than its baseline.

CI runs every default run of ``make demo`` except the 4-worker CNN pair: four workers sharing
2 cores take 15 of the demo's 40 minutes, and CI's whole run must stay under 45 minutes. The
README's table, from a full ``make demo``, has them.
"""
import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]

RUNS = [run for run in cli.DEFAULT_RUNS if not run.startswith("4:")]


@pytest.mark.timeout(3600)  # twelve training runs of one to four minutes, one at a time
def test_runs_within_one_point_of_their_baseline_on_mnist1d(tmp_path):
    out = tmp_path / "demo.json"
    cli.main(["demo", "--runs", ",".join(RUNS), "--out", str(out), "--timeout", "900"])
    results = json.load(open(out))
    assert [(r["model"], r["workers"], r["label"]) for r in results] == \
        [(run.model, run.workers, run.codec) for run in cli._parse_runs(",".join(RUNS))]
    for result in results:
        baseline = cli.baseline_accuracy(results, result)
        if result["label"] == cli.EXAMPLES[result["model"]].baseline:
            assert baseline >= 0.90, result
            continue
        assert result["test_accuracy"] >= baseline - 0.010, result
        assert result["compression_ratio"] > 5, result
