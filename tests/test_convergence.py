"""The main job's claim, on CI's budget: on MNIST-1D no run of the demo ends more than 2 points
below its baseline (uncompressed training with the same optimizer, or synchronous clipped SGD
for the GRU) with the same model, workers, seed and steps; every baseline reaches 90%; and
every run hands Horovod at least 5x fewer bytes than its baseline.

CI runs every default run of ``make demo`` except the 4-worker CNN pair (8 of the demo's 30
minutes), and the CNNs on half the demo's schedule: 1500 steps, the cosine decay ending at the
last. The full schedule made this test 22-29 of CI's 40-56 minutes, and CI's whole run must
stay under 45. The GRU keeps its example's 2000 steps: at 1000, CELGC's local run ended 2.9
points below synchronous SGD, against 0.4 at 2000. The README's table, from ``make demo``, has
the full schedule and the 4-worker pair.

Why 2 points for one seed when the codecs are within 1 point on average: on 1,000 test
signals a run's gap to its baseline moves from seed to seed. At 3000 steps, seeds 0-3 of the
heavy-ball codecs gave single gaps of -1.4 to +0.8 points (README, Results), and a 1-point
bound failed 3 of those 20 runs. At 1000 steps the spread is wider: seeds 0-2 gave -2.0 to
+1.1; at 1500, seeds 0 and 1 gave -0.6 to +1.4.
"""
import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]

SINGLE_SEED_TOLERANCE = 0.020
RUNS = [run for run in cli.DEFAULT_RUNS if not run.startswith("4:")]
CNN_STEPS = 1500


@pytest.mark.timeout(2400)  # twelve training runs of half a minute to three, one at a time
def test_runs_within_two_points_of_their_baseline_on_mnist1d(tmp_path):
    out = tmp_path / "demo.json"
    cli.main(["demo", "--runs", ",".join(RUNS), "--steps", str(CNN_STEPS), "--out", str(out),
              "--timeout", "900"])
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
