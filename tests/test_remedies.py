"""The settings the PyTorch wrapper chooses for a codec turned on by its name
(``hvd_compress.remedies``): compressed Adam for the error-feedback codecs under Adam and
AdamW, logged once; an explicit setting winning; a warning where the remedy cannot run or
the optimizer is unknown. The Keras wrapper's: ``tests/test_tf_compressed_adam.py``. One
1-process Horovod job (the wrapper needs ``hvd.init()``) builds them all."""

import pytest
import torch

from hvd_compress import remedies

from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params),
    "AdamW": lambda params: torch.optim.AdamW(params),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "SGD(nesterov)": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
    "RMSprop": lambda params: torch.optim.RMSprop(params),
    "Adam(amsgrad)": lambda params: torch.optim.Adam(params, amsgrad=True),
}
CODECS = ("none", "fp16", "terngrad", "qsgd-inf", "nuqsgd", "dgc", "ef-sign", "adacomp", "clt-k")
# (optimizer, codec, options): explicit settings and the adaptive mode.
EXPLICIT = [
    ("AdamW", "ef-sign", {"compressed_adam": 0}),
    ("AdamW", "ef-sign", {"compressed_adam": 50}),
    ("AdamW", "nuqsgd", {"compressed_adam": 50}),
    ("AdamW", "ef-sign", {"adaptive": True}),
]


def _choices():
    """T_w as each wrapper chose it (None: off) and the messages logged while building,
    per (optimizer, codec) and per ``EXPLICIT`` case."""
    import logging

    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("hvd_compress").addHandler(handler)

    def build(optimizer, codec, options):
        del logged[:]
        wrapped = hc.DistributedOptimizer(
            OPTIMIZERS[optimizer](torch.nn.Linear(4, 3).parameters()),
            compression=codec,
            **options,
        )
        adam = wrapped._hvdc_adam
        warmup = None if adam is None else adam.warmup_steps
        # What the wrapper chose is what its statistics report (the examples' bytes per
        # step are the run's mean under compressed Adam).
        assert wrapped.compression_stats()["compressed_adam"] == warmup
        return warmup, list(logged)

    return {
        "defaults": {(o, c): build(o, c, {}) for o in OPTIMIZERS for c in CODECS},
        "again": build("AdamW", "ef-sign", {}),  # logged once per process
        "explicit": [build(o, c, options) for o, c, options in EXPLICIT],
    }


@pytest.fixture(scope="module")
def choices():
    [result] = run_parallel(_choices, 1)
    return result


def test_error_feedback_codecs_under_adam_get_compressed_adam_logged_once(choices):
    for (optimizer, codec), (warmup, logged) in choices["defaults"].items():
        remedied = optimizer in ("Adam", "AdamW") and codec in ("ef-sign", "adacomp", "clt-k")
        assert warmup == (remedies.COMPRESSED_ADAM_WARMUP if remedied else None), (
            optimizer,
            codec,
        )
        if remedied:
            [message] = logged
            assert f"turned compressed Adam on for {codec} with {optimizer}" in message
            assert "compressed_adam=0" in message and "compressed_adam=T_w" in message
    assert choices["again"] == (remedies.COMPRESSED_ADAM_WARMUP, [])


def test_codecs_without_a_remedy_log_nothing(choices):
    for (optimizer, codec), (_, logged) in choices["defaults"].items():
        if codec not in ("ef-sign", "adacomp", "clt-k") or optimizer == "SGD(nesterov)":
            assert logged == [], (optimizer, codec)
        if optimizer == "SGD" and codec != "ef-sign":
            assert logged == [], (optimizer, codec)


def test_ef_sign_with_heavy_ball_momentum_is_warned_with_the_setting_that_closes_the_gap(
    choices,
):
    warmup, [message] = choices["defaults"]["SGD", "ef-sign"]
    assert warmup is None
    assert "ef-sign with heavy-ball momentum ended 2.1-3.4 points below" in message
    assert "nesterov=True" in message and "ef-sign:max_block_size=256" in message


def test_an_explicit_setting_wins(choices):
    (off, off_logged), (fifty, _), (nuqsgd, _), _ = choices["explicit"]
    assert (off, off_logged, fifty, nuqsgd) == (None, [], 50, 50)


def test_where_the_remedy_cannot_run_the_wrapper_warns(choices):
    warmup, [message] = choices["defaults"]["Adam(amsgrad)", "ef-sign"]
    assert warmup is None
    assert "the remedy, cannot run here (does not support amsgrad=True)" in message
    warmup, [message] = choices["explicit"][3]
    assert warmup is None and "(does not combine with adaptive)" in message
    warmup, [message] = choices["defaults"]["RMSprop", "ef-sign"]
    assert warmup is None and "RMSprop is not one the wrappers know" in message
