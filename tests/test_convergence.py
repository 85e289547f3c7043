"""The main job's claim: on MNIST-1D with 2 workers TernGrad is within 1 point of uncompressed
training with the same seed and steps, and the uncompressed CNN reaches 90%."""
import json

import pytest

from hvd_compress import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]


def test_terngrad_within_one_point_on_mnist1d(tmp_path):
    out = tmp_path / "demo.json"
    cli.main(["demo", "--codecs", "none,terngrad", "--out", str(out), "--timeout", "900"])
    none, terngrad = json.load(open(out))
    assert none["test_accuracy"] >= 0.90
    assert abs(terngrad["test_accuracy"] - none["test_accuracy"]) <= 0.010
    assert terngrad["compression_ratio"] > 10
