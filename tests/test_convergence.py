"""The main job's claim: on MNIST-1D no run of the demo ends more than 2 points below its
baseline (uncompressed training with the same optimizer, or synchronous clipped SGD for the
GRU) with the same model, workers, seed and steps; every baseline reaches 90%; and every run
hands Horovod at least 5x fewer bytes than its baseline.

Why 2 points for one seed when the codecs are within 1 point on average: on 1,000 test
signals a run's gap to its baseline moves by up to 2.1 points from seed to seed (the
heavy-ball codecs, seeds 0-3 on CI's machine type: mean gaps -0.7 to +0.1 points, single runs
-1.4 to +0.8; README, Results), and a 1-point bound on one seed failed 3 of those 20 runs.

CI runs every default run of ``make demo`` except the 4-worker CNN pair: four workers sharing
2 cores take 8 of the demo's 30 minutes, and CI's whole run must stay under 45 minutes. The
README's table, from a full ``make demo``, has them.
"""
import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]

SINGLE_SEED_TOLERANCE = 0.020
RUNS = [run for run in cli.DEFAULT_RUNS if not run.startswith("4:")]


@pytest.mark.timeout(3600)  # twelve training runs of one to four minutes, one at a time
def test_runs_within_two_points_of_their_baseline_on_mnist1d(tmp_path):
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
        assert result["test_accuracy"] >= baseline - SINGLE_SEED_TOLERANCE, result
        assert result["compression_ratio"] > 5, result
