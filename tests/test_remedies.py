"""The settings the PyTorch wrapper chooses for a codec turned on by its name
(``hvd_compress.remedies``): compressed Adam for the error-feedback codecs under Adam and
AdamW, and ef-sign's and DGC's worker momentum in Nesterov's form under a heavy-ball SGD,
each logged once; an explicit setting winning; a warning where the remedy cannot run or the
optimizer is unknown. The Keras wrapper's: ``tests/test_tf_compressed_adam.py``. One
1-process Horovod job (the wrapper needs ``hvd.init()``) builds them all."""

import pytest
import torch

from hvd_compress import registry, remedies

from .harness import run_parallel
from .logs import record_messages

pytestmark = pytest.mark.multiprocess

OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params),
    "AdamW": lambda params: torch.optim.AdamW(params),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "SGD(nesterov)": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
    "RMSprop": lambda params: torch.optim.RMSprop(params),
    "Adam(amsgrad)": lambda params: torch.optim.Adam(params, amsgrad=True),
}
CODECS = tuple(registry.CODECS)
# The codecs that compressed Adam is chosen for under Adam and AdamW.
ERROR_FEEDBACK = ("ef-sign", "adacomp", "clt-k", "dgc")
# (optimizer, codec, options): explicit settings and the adaptive mode.
EXPLICIT = [
    ("SGD(nesterov)", "terngrad:clip=2.0", {}),
    ("AdamW", "ef-sign", {"compressed_adam": 0}),
    ("AdamW", "ef-sign", {"compressed_adam": 50}),
    ("AdamW", "nuqsgd", {"compressed_adam": 50}),
    ("AdamW", "ef-sign", {"adaptive": True}),
    ("SGD", "ef-sign", {"worker_momentum": True}),
    ("SGD", "dgc", {"worker_momentum": True}),
    ("SGD", "ef-sign", {"worker_momentum": False}),
    ("AdamW", "qsgd:bits=8", {}),
    ("AdamW", "dgc", {"compressed_adam": 0}),
]


def _choices():
    """T_w and the worker momentum's form as each wrapper chose them (None: off) and the
    messages logged while building, per (optimizer, codec) and per ``EXPLICIT`` case; and
    the error of a ``worker_momentum`` no wrapper takes."""

    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    logged = record_messages()

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
        momentum = wrapped._hvdc_momentum
        form = None if momentum is None else "nesterov" if momentum.nesterov else "optimizer"
        return warmup, form, list(logged)

    try:
        build("SGD", "ef-sign", {"worker_momentum": "heavy-ball"})
    except ValueError as error:
        refused = str(error)
    return {
        "defaults": {(o, c): build(o, c, {}) for o in OPTIMIZERS for c in CODECS},
        "again": build("AdamW", "ef-sign", {}),  # logged once per process
        "again_sgd": build("SGD", "ef-sign", {}),
        "explicit": [build(o, c, options) for o, c, options in EXPLICIT],
        "refused": refused,
    }


@pytest.fixture(scope="module")
def choices():
    [result] = run_parallel(_choices, 1)
    return result


def test_error_feedback_codecs_under_adam_get_compressed_adam_logged_once(choices):
    for (optimizer, codec), (warmup, _, logged) in choices["defaults"].items():
        remedied = optimizer in ("Adam", "AdamW") and codec in ERROR_FEEDBACK
        assert warmup == (remedies.COMPRESSED_ADAM_WARMUP if remedied else None), (
            optimizer,
            codec,
        )
        if remedied:
            [message] = [m for m in logged if "turned compressed Adam on" in m]
            assert f"turned compressed Adam on for {codec} with {optimizer}" in message
            assert "compressed_adam=0" in message and "compressed_adam=T_w" in message
    assert choices["again"] == (remedies.COMPRESSED_ADAM_WARMUP, None, [])


def test_codecs_without_a_remedy_log_nothing(choices):
    for (optimizer, codec), (_, _, logged) in choices["defaults"].items():
        known = set(ERROR_FEEDBACK) | set(remedies.ADAM_GAPS)
        if optimizer == "SGD(nesterov)":
            known = set(remedies.NESTEROV_GAPS)
        if codec not in known:
            assert logged == [], (optimizer, codec)
        if optimizer == "SGD" and not registry.resolve(codec).nesterov_remedy:
            assert logged == [], (optimizer, codec)


def test_codecs_behind_adamw_by_name_are_warned_with_the_gap_and_what_closes_it(choices):
    for codec, (gap, closer) in remedies.ADAM_GAPS.items():
        for optimizer in ("Adam", "AdamW"):
            _, _, logged = choices["defaults"][optimizer, codec]
            [message] = [m for m in logged if "with its defaults" in m]
            assert f"{codec} with its defaults under {optimizer} ended {gap}" in message
            assert closer in message
    # Not the configurations measured: other hyperparameters, compressed Adam turned off.
    *_, other_bits, dgc_without = choices["explicit"]
    assert other_bits[2] == [] and dgc_without == (None, None, [])


def test_codecs_behind_nesterov_by_name_are_warned_with_the_gap_and_what_closes_it(choices):
    for codec, (gap, closer) in remedies.NESTEROV_GAPS.items():
        [message] = choices["defaults"]["SGD(nesterov)", codec][2]
        assert f"{codec} with its defaults under SGD with Nesterov momentum {gap}" in message
        assert closer in message
        # Heavy-ball momentum is the setting that closes it: no warning there.
        assert choices["defaults"]["SGD", codec][2] == []
    # Not the configuration measured: another clipping factor.
    assert choices["explicit"][0] == (None, None, [])


def test_worker_momentum_is_on_for_ef_sign_and_dgc_under_sgd_with_momentum(choices):
    for (optimizer, codec), (_, form, _) in choices["defaults"].items():
        if optimizer.startswith("SGD") and codec in ("ef-sign", "dgc"):
            nesterov = optimizer == "SGD"
            assert form == ("nesterov" if nesterov else "optimizer"), (optimizer, codec)
        else:
            assert form is None, (optimizer, codec)


def test_ef_sign_and_dgc_under_heavy_ball_take_nesterovs_form_logged_once(choices):
    for codec in ("ef-sign", "dgc"):
        warmup, form, [message] = choices["defaults"]["SGD", codec]
        assert (warmup, form) == (None, "nesterov")
        assert f"{codec}'s worker momentum in Nesterov's form" in message
        assert remedies.HEAVY_BALL_GAPS[codec] in message and "worker_momentum=True" in message
    assert set(remedies.HEAVY_BALL_GAPS) == {
        name for name in CODECS if registry.resolve(name).nesterov_remedy
    }
    assert choices["again_sgd"] == (None, "nesterov", [])


def test_an_explicit_setting_wins(choices):
    _, off, fifty, nuqsgd, _, heavy_ball, dgc, no_momentum, *_ = choices["explicit"]
    assert (off, fifty[0], nuqsgd[0]) == ((None, None, []), 50, 50)
    assert heavy_ball == (None, "optimizer", [])
    assert dgc == (None, "optimizer", [])
    assert no_momentum == (None, None, [])


def test_a_worker_momentum_no_wrapper_takes_is_refused_naming_the_values(choices):
    assert "worker_momentum must be None" in choices["refused"]
    assert "'nesterov', got 'heavy-ball'" in choices["refused"]


def test_where_the_remedy_cannot_run_the_wrapper_warns(choices):
    warmup, _, [message] = choices["defaults"]["Adam(amsgrad)", "ef-sign"]
    assert warmup is None
    assert "the remedy, cannot run here (does not support amsgrad=True)" in message
    warmup, _, [message] = choices["explicit"][4]
    assert warmup is None and "(does not combine with adaptive)" in message
    warmup, _, [message] = choices["defaults"]["RMSprop", "ef-sign"]
    assert warmup is None and "RMSprop is not one the wrappers know" in message


def test_a_codec_of_the_users_that_asks_for_nesterovs_form_gets_it_without_a_gap():
    class Mine(registry.CODECS["ef-sign"]):
        name = "mine"

    logged = record_messages()
    form = remedies.worker_momentum("Owner", Mine(), None, sgd_momentum=True, heavy_ball=True)
    assert form == "nesterov"
    [message] = [m for m in logged if "mine's worker momentum" in m]
    assert "because" not in message and "worker_momentum=True" in message
