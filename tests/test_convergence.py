"""The main job's claim: on MNIST-1D with 2 workers no codec of the demo ends more than 1 point
below uncompressed training with the same seed and steps, and the uncompressed CNN reaches
90%."""
import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]


@pytest.mark.timeout(3600)  # four training runs of about two minutes each, one at a time
def test_codecs_within_one_point_on_mnist1d(tmp_path):
    out = tmp_path / "demo.json"
    cli.main(["demo", "--out", str(out), "--timeout", "900"])
    none, *compressed = json.load(open(out))
    assert none["compression"] == "none" and none["test_accuracy"] >= 0.90
    assert [r["compression"] for r in compressed] == ["terngrad", "qsgd-inf", "nuqsgd"]
    for result in compressed:
        assert result["test_accuracy"] >= none["test_accuracy"] - 0.010, result
        assert result["compression_ratio"] > 5
