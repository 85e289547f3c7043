"""The main job's claim: on MNIST-1D no codec of the demo ends more than 1 point below
uncompressed training with as many workers, the same seed and steps, and the uncompressed
CNN reaches 90%."""
import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]


@pytest.mark.timeout(3600)  # six training runs of about two minutes, one at a time
def test_codecs_within_one_point_on_mnist1d(tmp_path):
    out = tmp_path / "demo.json"
    cli.main(["demo", "--out", str(out), "--timeout", "900"])
    results = json.load(open(out))
    assert [f"{r['workers']}:{r['compression']}" for r in results] == cli.DEFAULT_RUNS
    none = {r["workers"]: r for r in results if r["compression"] == "none"}
    assert all(r["test_accuracy"] >= 0.90 for r in none.values())
    for result in results:
        if result["compression"] != "none":
            assert result["test_accuracy"] >= none[result["workers"]]["test_accuracy"] - 0.010, \
                result
            assert result["compression_ratio"] > 5
