"""The language-model task: the corpus split, and each framework's example for a few steps
at N = 2, the PyTorch one with its baseline through the demo's table. The accuracy claims,
compressed Adam's among them, are the demo's (``make demo-full``), on the full schedule and
several seeds."""

import math

import pytest

from hvd_compress.examples import cli, corpus

from .harness import run_parallel


def test_corpus_is_split_by_file_without_test_suites():
    files = corpus.source_files()
    assert files == sorted(files, key=lambda p: p.as_posix())
    assert not any({"test", "tests", "idle_test", "site-packages"} & set(p.parts) for p in files)
    train, validation = corpus.load_stdlib_text()
    held_out = files[:: corpus.VALIDATION_EVERY]
    assert validation.size == sum(p.stat().st_size + 1 for p in held_out)
    assert train.size == sum(p.stat().st_size + 1 for p in files) - validation.size
    assert train.size > 5 * validation.size > 5_000_000


def _lm_runs(model, codecs):
    """The example of ``model`` ("lm": PyTorch, "keras-lm": Keras) for 6 steps with each
    of ``codecs``."""
    if model == "lm":
        import horovod.torch as hvd

        from hvd_compress.examples import lm_torch as example
    else:
        import horovod.tensorflow as hvd

        from hvd_compress.examples import lm_keras as example
    hvd.init()
    return [
        dict(
            example.main(["--compression", codec, "--steps", "6", "--warmup", "2"]),
            model=model,
            label=codec,
            optimizer="adamw",
        )
        for codec in codecs
    ]


@pytest.mark.multiprocess
def test_language_model_trains_and_reports_bits_per_byte():
    results, other = run_parallel(_lm_runs, 2, "lm", ("none", "terngrad"), timeout=300)
    _check_ranks_agree(results, other)
    none, terngrad = results
    assert none["compression_ratio"] == 1 and terngrad["compression_ratio"] > 5
    table = cli.format_table(results)
    versus = terngrad["validation_bits_per_byte"] - none["validation_bits_per_byte"]
    assert (
        f"| adamw | terngrad | {terngrad['validation_bits_per_byte']:.3f} bits/byte | "
        f"{versus:+.3f} bits/byte |" in table
    )


@pytest.mark.multiprocess
def test_keras_language_model_trains_compressed():
    """The Keras example with TernGrad alone: the table and the baseline's row are the
    PyTorch test's, the same code for both."""
    results, other = run_parallel(_lm_runs, 2, "keras-lm", ("terngrad",), own_job=True)
    _check_ranks_agree(results, other)
    assert results[0]["compression_ratio"] > 5


def _check_ranks_agree(results, other):
    """Every rank ends with the same validation loss, and the model learned: its loss fell
    by a fifth in the few steps, where a step that changed nothing would leave it."""
    for result, twin in zip(results, other):
        assert result["validation_bits_per_byte"] == twin["validation_bits_per_byte"]
        assert math.isfinite(result["validation_bits_per_byte"])
        assert (
            result["validation_bits_per_byte"] < 0.8 * result["initial_validation_bits_per_byte"]
        ), result
