"""What the wrappers set for a user who turns a codec on by its name and keeps the optimizer
they had, where the codec is known to train worse without it.

Codecs that lean on error feedback (ef-sign, AdaComp, CLT-k, DGC: ``Codec.adam_remedy``)
disturb Adam's second moment when they compress its gradients: on the byte-level LM under
AdamW they ended 20-46% of the bits per byte behind uncompressed AdamW, and with compressed
Adam's T_w = 200 uncompressed steps of 600 ef-sign, AdaComp and CLT-k within 1.5%, DGC
within 3.6% (docs/benchmarks.md, "Every codec by its name alone"). So the
wrappers turn compressed Adam on for them under Adam and AdamW, log once what they chose and
how to change it, and warn where it cannot apply: an Adam with an option compressed Adam
refuses, the adaptive mode, an optimizer they do not recognise. An explicit
``compressed_adam`` always wins (``0`` turns the mode off). Codecs that still end more than
2% behind AdamW by their name alone get a warning with the gap and the setting that closed
it (``ADAM_GAPS``, ``adam_gap``), and so do codecs that end more than 1 point of accuracy
behind SGD with Nesterov momentum or diverge where it trains (``NESTEROV_GAPS``,
``nesterov_gap``): the wrappers choose
modes of their own (compressed Adam, the worker momentum's form), never a codec's
hyperparameters, which a user may have set to their defaults on purpose.

ef-sign's worker momentum is dist-EF-blockSGDM's, which the authors' code applies in
Nesterov's form (u = g + mu m). Applied in a heavy-ball SGD's form (u = m) it ended 2.1-3.4
points of MNIST-1D test accuracy below uncompressed heavy-ball SGD on the CNN (2 workers, two
seeds), and 0.9 below it in Nesterov's form (docs/benchmarks.md, "ef-sign and the kind of
momentum"); DGC's momentum correction in the heavy-ball form ended 1.20 points below on
average (three seeds), 0.37 in Nesterov's form. The worker momentum replaces the optimizer's
(the base SGD steps without it), so its form is the mode's own: for codecs that need it
(``Codec.nesterov_remedy``) the wrappers choose Nesterov's form under a heavy-ball SGD and
log once (``worker_momentum``); an explicit ``worker_momentum=True`` keeps the optimizer's
form.

``kind`` names the user's optimizer as the ports recognise it: ``"sgd"``, ``"adam"``
(Adam and AdamW), or ``"other"``.
"""

from __future__ import annotations

import logging

from .validation import check_int

# T_w that the wrappers choose: 1-bit Adam's warm-up, long enough for Adam's variance to
# settle before it is frozen (200 of the LM's 600 steps; DeepSpeed's guidance is 15-25% of
# training, which the wrappers cannot know at construction).
COMPRESSED_ADAM_WARMUP = 200

# How far each codec whose worker momentum took the heavy-ball form ended below uncompressed
# heavy-ball SGD on the CNN (2 workers; docs/benchmarks.md, "ef-sign and the kind of
# momentum" and "Every codec by its name alone").
HEAVY_BALL_GAPS = {
    "ef-sign": "2.1-3.4 points (two seeds)",
    "dgc": "0.5-1.8 points (1.20 on average over three seeds)",
}

# Codecs that, by their name alone and with what the wrappers choose, still trained more
# than 2% behind uncompressed AdamW on the byte-level LM in either port (2 workers, seeds 0
# and 1): the gap and the setting that closed it (docs/benchmarks.md, "Every codec by its
# name alone" and "A transformer with AdamW").
ADAM_GAPS = {
    "terngrad": (
        "1.4-1.5% behind uncompressed AdamW in PyTorch and 1.9-3.0% in Keras",
        "compression='qsgd-inf', at about the same bytes (7.6x fewer against 6.0x), ended "
        "within 0.3% in both",
    ),
    "qsgd": (
        "1.8-2.5% behind uncompressed AdamW",
        "compression='qsgd-inf', at the same bytes, ended within 0.3%",
    ),
    "powersgd": (
        "1.6-2.8% behind uncompressed AdamW",
        "compression='powersgd:rank=4' ended within 1.1%, for 29x fewer bytes instead of 50x",
    ),
    "dgc": (
        "2.8-3.6% behind uncompressed AdamW with the compressed Adam the wrappers turn on "
        "for it (46% without)",
        "compression='dgc:density=0.01' ended within 0.8%",
    ),
}

# Codecs that, by their name alone, trained more than 1 point of test accuracy behind
# uncompressed Nesterov SGD on the CNN (2 workers, lr 0.1 cosine, momentum 0.9; seeds 0-7,
# each against the uncompressed run of its seed), or diverged where it trained, with the
# setting that closed it (docs/benchmarks.md, "Every codec by its name alone"). No setting
# of the wrappers' own did: TernGrad is unbiased, with nothing to compensate, and ternary
# codes with a scale per bucket of 512 (compression='qsgd-inf:bits=2') diverged on two of
# five seeds. Nesterov SGD at this rate trains at the edge of stability, and every codec
# trained on every seed under heavy-ball momentum.
NESTEROV_GAPS = {
    "terngrad": (
        "ended 1.60 points of test accuracy behind uncompressed Nesterov SGD on average "
        "(eight seeds, 0.6 to 2.8 behind on every one)",
        "compression='nuqsgd' ended 0.44 behind on average (five seeds) for 7.2x fewer "
        "bytes instead of 12.9x, and TernGrad under heavy-ball momentum (nesterov=False) "
        "0.37 behind uncompressed heavy-ball SGD (three seeds)",
    ),
    "qsgd-inf": (
        "diverged on one of eight seeds (the weights became NaN), where uncompressed "
        "Nesterov SGD trained on all eight; on the seven that trained it ended 0.23 points "
        "of test accuracy behind on average",
        "under heavy-ball momentum (nesterov=False) it trained on every seed, 0.23 ahead of "
        "uncompressed heavy-ball SGD (three seeds); a warm-up of the learning rate keeps "
        "the first steps stable",
    ),
    "powersgd": (
        "diverged on one of eight seeds (the weights became NaN), where uncompressed "
        "Nesterov SGD trained on all eight; on the seven that trained it ended 0.57 points "
        "of test accuracy ahead on average",
        "under heavy-ball momentum (nesterov=False) it trained on every seed, 0.13 behind "
        "uncompressed heavy-ball SGD (three seeds); a warm-up of the learning rate keeps "
        "the first steps stable",
    ),
}

_logged: set[str] = set()


def log_once(message: str) -> None:
    """Logs ``message`` as a warning of the ``hvd_compress`` logger, once per process."""
    if message not in _logged:
        _logged.add(message)
        logging.getLogger("hvd_compress").warning("%s", message)


def compressed_adam(
    owner: str,
    codec,
    kind: str,
    optimizer_name: str,
    explicit: int | None,
    refusal: str | None = None,
) -> int | None:
    """T_w of compressed Adam for ``codec`` with the user's optimizer (``kind``, named
    ``optimizer_name``), or None for the mode off. ``explicit``: the user's
    ``compressed_adam`` (None: choose; 0: off). ``refusal``: why compressed Adam cannot run
    with this optimizer or these options (an Adam option it refuses, the adaptive mode),
    which turns the choice into a warning. Warns too where ``codec`` by its name still
    trained behind uncompressed AdamW (``adam_gap``)."""
    adam_gap(owner, codec, kind, optimizer_name, chosen=explicit is None)
    if explicit is not None:
        warmup = check_int(owner, "compressed_adam", explicit, low=0)
        return warmup or None
    if not codec.adam_remedy:
        return None
    gap = (
        f"{codec.name} compressing Adam's gradients ended 20-46% behind uncompressed AdamW "
        f"on this project's language model"
    )
    if kind == "adam" and refusal is None:
        log_once(
            f"hvd_compress: {owner} turned compressed Adam on for {codec.name} with "
            f"{optimizer_name} (compressed_adam={COMPRESSED_ADAM_WARMUP}: uncompressed "
            f"steps before Adam's variance is frozen and the momentum goes through the "
            f"codec), because {gap}. Pass compressed_adam=T_w to choose another warm-up "
            f"(1-bit Adam's guidance: 15-25% of the steps) or compressed_adam=0 to "
            f"compress the gradients."
        )
        return COMPRESSED_ADAM_WARMUP
    if kind == "adam":
        log_once(
            f"hvd_compress: {owner}: {gap}, and compressed Adam, the remedy, cannot run "
            f"here ({refusal}); expect {codec.name} to train worse than uncompressed "
            f"{optimizer_name}, or use a codec without error feedback (qsgd-inf, terngrad)."
        )
    elif kind == "other":
        log_once(
            f"hvd_compress: {owner}: {codec.name} leans on error feedback, and with an "
            f"adaptive optimizer (Adam) {gap} unless Adam's own mode, compressed_adam, was "
            f"on. {optimizer_name} is not one the wrappers know; if it scales steps by "
            f"gradient statistics, compare against uncompressed training or use a codec "
            f"without error feedback (qsgd-inf, terngrad)."
        )
    return None


def adam_gap(owner: str, codec, kind: str, optimizer_name: str, chosen: bool) -> None:
    """Warns, once, where ``codec`` with its default hyperparameters trained more than 2%
    behind uncompressed AdamW on the LM with what the wrappers choose (``chosen``: the
    user left ``compressed_adam`` to them), naming the gap and what closes it."""
    known = ADAM_GAPS.get(codec.name)
    if kind != "adam" or not chosen or known is None:
        return
    if codec.params() != type(codec)().params():
        return  # measured with the defaults only
    gap, closer = known
    log_once(
        f"hvd_compress: {owner}: {codec.name} with its defaults under {optimizer_name} "
        f"ended {gap}, in validation bits per byte on this project's language model (2 "
        f"workers, two seeds); {closer}."
    )


def nesterov_gap(owner: str, codec, nesterov: bool) -> None:
    """Warns, once, where ``codec`` with its default hyperparameters trained more than 1
    point behind uncompressed SGD with Nesterov momentum, or diverged where it trained
    (``nesterov``: the user's optimizer is one), on this project's CNN, naming the gap and
    what closes it (``NESTEROV_GAPS``)."""
    known = NESTEROV_GAPS.get(codec.name)
    if not nesterov or known is None or codec.params() != type(codec)().params():
        return
    gap, closer = known
    log_once(
        f"hvd_compress: {owner}: {codec.name} with its defaults under SGD with Nesterov "
        f"momentum {gap}, on this project's CNN (2 workers); {closer}."
    )


def worker_momentum(
    owner: str, codec, explicit: bool | str | None, sgd_momentum: bool, heavy_ball: bool
) -> str | None:
    """The worker-momentum mode for ``codec`` with the user's optimizer: None (off),
    ``"optimizer"`` (momentum in the optimizer's form) or ``"nesterov"`` (in Nesterov's).
    ``explicit``: the user's ``worker_momentum`` (None: choose). ``sgd_momentum``: the
    optimizer is an SGD with momentum; ``heavy_ball``: one without Nesterov's form."""
    if explicit is None:
        if not (codec.worker_momentum_default and sgd_momentum):
            return None
        if codec.nesterov_remedy and heavy_ball:
            gap = HEAVY_BALL_GAPS.get(codec.name)  # a codec of the user's may have none
            because = (
                ""
                if gap is None
                else f", because {codec.name} with heavy-ball momentum ended {gap} below "
                f"uncompressed heavy-ball SGD on this project's CNN"
            )
            log_once(
                f"hvd_compress: {owner} applies {codec.name}'s worker momentum in Nesterov's "
                f"form (worker_momentum='nesterov') where the optimizer has heavy-ball "
                f"momentum{because}. Pass worker_momentum=True to keep the optimizer's form."
            )
            return "nesterov"
        return "optimizer"
    if not any(explicit is value for value in (False, True)) and explicit != "nesterov":
        raise ValueError(
            f"{owner}: worker_momentum must be None (the codec's default), True, False or "
            f"'nesterov', got {explicit!r}"
        )
    if explicit is False:
        return None
    return "nesterov" if explicit == "nesterov" else "optimizer"
