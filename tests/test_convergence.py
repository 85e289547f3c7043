"""The main job's claim, on CI's budget: on MNIST-1D no run of the demo ends more than 2 points
below its baseline (uncompressed training with the same optimizer, or synchronous clipped SGD
for the GRU) with the same model, workers, seed and steps; every baseline reaches 90%; and
every run hands Horovod at least 5x fewer bytes than its baseline.

CI runs every MNIST-1D run of ``make demo-full`` (``cli.FULL_RUNS``) except the 4-worker CNN
pair, the Keras pair, the adaptive run and the peers' codecs (PowerSGD, DGC), on the demo's own
schedule (3000 CNN steps); of the language model's runs, ``tests/test_lm.py`` checks compressed
Adam's on a shortened schedule. The Keras pair would cost CI three minutes for arithmetic
checked elsewhere: the TensorFlow codecs equal the PyTorch port's byte for byte
(``tests/test_tf_codecs.py``), the Keras optimizer's worker momentum keeps
dist-EF-blockSGDM's invariant and reduces to Keras's Nesterov SGD
(``tests/test_tf_momentum.py``), and the Keras example trains from the wheel
(``tests/test_wheel.py``). Half of
the CNN's schedule, 1500 steps with the cosine decay ending at the last, does not show the
claim: the compressed runs have not caught up by then (over seeds 0-2, AdaComp ends 1.0-2.1
points and TernGrad 0.3-2.4 points below their baselines at 1500 steps, against 0.3-0.7 at
3000).

Why 2 points for one seed when the codecs are within 1 point on average: on 1,000 test
signals a run's gap to its baseline moves from seed to seed. At 3000 steps, seeds 0-3 of the
heavy-ball codecs gave single gaps of -1.4 to +0.8 points (README, Results), and a 1-point
bound failed 3 of those 20 runs.
"""

import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]

SINGLE_SEED_TOLERANCE = 0.020
# The adaptive run is left out: on localhost it sends by fp32 what its baseline sends, and its
# switching is tested in tests/test_adaptive_distributed.py. So are the peers' codecs, for
# CI's time: PowerSGD is checked against torch's own hook and DGC against the numpy
# reference (tests/test_powersgd.py, tests/test_dgc.py).
RUNS = [
    run
    for run in cli.FULL_RUNS
    if not run.startswith(("4:", "keras/", "lm/", "keras-lm/"))
    and not run.endswith(cli.ADAPTIVE_SUFFIX)
    and run not in cli.PEER_RUNS
]


@pytest.mark.timeout(3000)  # ten training runs of one to two minutes, one at a time
def test_runs_within_two_points_of_their_baseline_on_mnist1d(tmp_path):
    out = tmp_path / "demo.json"
    cli.main(["demo", "--runs", ",".join(RUNS), "--out", str(out), "--timeout", "900"])
    results = json.load(open(out))
    assert [(r["model"], r["workers"], r["label"]) for r in results] == [
        (run.model, run.workers, run.codec) for run in cli._parse_runs(",".join(RUNS))
    ]
    for result in results:
        baseline = cli.baseline_accuracy(results, result)
        if result["label"] == cli.EXAMPLES[result["model"]].baseline:
            assert baseline >= 0.90, result
            continue
        assert result["test_accuracy"] >= baseline - SINGLE_SEED_TOLERANCE, result
        assert result["compression_ratio"] > 5, result
