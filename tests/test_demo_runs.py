"""The demo command's run lists and tables, without training: every list parses, the
defaults matrix holds every codec under each optimizer, ``--seeds`` is checked, and the
seeds table compares each run with the baseline of its own seed."""

import argparse

import pytest

from hvd_compress.examples import cli
from hvd_compress.registry import CODECS


@pytest.mark.parametrize("runs", [cli.DEFAULT_RUNS, cli.FULL_RUNS, cli.DEFAULTS_RUNS])
def test_every_run_list_parses(runs):
    assert len(cli._parse_runs(",".join(runs))) == len(runs)


def test_the_defaults_matrix_has_every_codec_by_its_name_alone():
    runs = cli._parse_runs(",".join(cli.DEFAULTS_RUNS))
    by_setting = {}
    for run in runs:
        by_setting.setdefault((run.model, run.workers, run.optimizer), []).append(run.codec)
    assert by_setting == {
        ("cnn", 2, "sgd"): list(CODECS),
        ("cnn", 2, "nesterov"): list(CODECS),
        ("lm", 2, None): list(CODECS),
    }


@pytest.mark.parametrize("text", ["", "0,,1", "1,1", "-1", "a"])
def test_bad_seeds_are_named(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--seeds takes distinct integers"):
        cli._parse_seeds(text)


def _result(label, seed, accuracy):
    return dict(
        model="cnn", workers=2, optimizer="sgd", label=label, seed=seed, test_accuracy=accuracy
    )


def test_the_seeds_table_compares_each_run_with_the_baseline_of_its_seed():
    results = [
        _result("none", 0, 0.97),
        _result("terngrad", 0, 0.96),
        _result("none", 1, 0.95),
        _result("terngrad", 1, 0.955),
    ]
    table = cli.format_seeds_table(results, [0, 1])
    assert "| seed 0 | seed 1 | mean gap | spread |" in table
    assert "| PyTorch CNN | 2 | sgd | terngrad | -1.000 | +0.500 | -0.250 | 1.500 |" in table
    assert "| none |" not in table
