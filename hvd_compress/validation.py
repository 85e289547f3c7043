"""Checks of user-supplied hyperparameters that name the parameter and what is allowed."""

import math
import numbers

from .cost import EXCHANGES, TWO_LEVEL, exchanges_for


def check_int(owner, name, value, *, low=None, high=None):
    """Returns ``value`` if it is an integer in [low, high]; raises otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer, got {value!r}")
    _check_range(owner, name, value, low, high)
    return int(value)


def check_float(owner, name, value, *, low=None, high=None):
    """Returns ``value`` as a float if it is a finite real number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    _check_range(owner, name, value, low, high)
    return float(value)


def check_bool(owner, name, value):
    """Returns ``value`` if it is True or False; raises otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
    return value


def check_choice(owner, name, value, choices):
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: {name} must be one of {allowed}; got {value!r}")
    return value


def _check_range(owner, name, value, low, high):
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            allowed = f">= {low}"
        elif low is None:
            allowed = f"<= {high}"
        else:
            allowed = f"in [{low}, {high}]"
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")


def check_reduction(owner, op, gradient_predivide_factor, *, average, sum_):
    """Horovod's ``op`` and ``gradient_predivide_factor`` checked; returns whether the op
    averages and the (prescale, postscale) factors of the uncompressed allreduces.
    ``average``, ``sum_``: the port's ``hvd.Average`` and ``hvd.Sum``."""
    if op not in (average, sum_):
        raise ValueError(
            f"{owner}: op must be hvd.Average or hvd.Sum (Adasum does not compose with "
            f"compressed codes)"
        )
    predivide = check_float(owner, "gradient_predivide_factor", gradient_predivide_factor, low=0.0)
    if predivide == 0:
        raise ValueError(f"{owner}: gradient_predivide_factor must be > 0")
    if predivide != 1.0 and op != average:
        raise ValueError(f"{owner}: gradient_predivide_factor needs op=hvd.Average")
    return op == average, (1.0 / predivide, predivide)


def check_two_level_process_set(is_global: bool) -> None:
    """``exchange="two-level"`` on the global process set only: it makes its own sets."""
    if not is_global:
        raise ValueError(
            "exchange='two-level' groups the ranks by node itself; it runs on the "
            "global process set only"
        )


def check_exchange(owner, codec, exchange):
    """``exchange`` checked: ``"auto"``, an exchange that ``codec``'s codes can take, or
    ``"two-level"`` for a dense codec."""
    check_choice(owner, "exchange", exchange, ("auto",) + EXCHANGES + (TWO_LEVEL,))
    if exchange == TWO_LEVEL:
        if codec.sparse:
            raise ValueError(
                f"{owner}: exchange='two-level' compresses each node's average of a tensor; "
                f"{codec.name} selects what it sends from each worker's own memory, so it "
                f"cannot (dense codecs can)"
            )
        return exchange
    if exchange != "auto" and codec.code_space is not None and exchange not in exchanges_for(codec):
        raise ValueError(
            f"{owner}: {codec.name} codes cannot travel by exchange={exchange!r}; they can "
            f"by {exchanges_for(codec)} or 'auto'"
        )
    return exchange


def check_error_feedback(owner, codec, error_feedback):
    """``error_feedback`` resolved against the codec's default (None), refused for codecs
    that are unsound without it."""
    if error_feedback is None:
        error_feedback = codec.error_feedback_default
    if codec.two_way and not error_feedback:
        raise ValueError(
            f"{owner}: {codec.name} compresses on the workers and again on the "
            f"server, which is only sound with error feedback on both; it cannot "
            f"run with error_feedback=False"
        )
    if codec.sparse and not error_feedback:
        raise ValueError(
            f"{owner}: {codec.name} chooses what to send from its error-feedback "
            f"memory; it cannot run with error_feedback=False"
        )
    return bool(error_feedback)


def check_compressed_adam_codec(owner, codec):
    """Refuses compressed Adam with a codec that sends every tensor whole during warm-up
    steps of its own (PowerSGD's ``start_iter``): both would route each step's tensors."""
    if codec.uncompressed_steps:
        raise ValueError(
            f"{owner}: compressed_adam has a warm-up of its own and does not combine with "
            f"{codec.name}'s uncompressed start (start_iter={codec.uncompressed_steps}); "
            f"use one of the two"
        )


# Keywords of Horovod's wrappers that hvd_compress takes for drop-in compatibility but only
# at Horovod's default: (default, why another value is refused, what to do instead).
HOROVOD_DEFAULTS = {
    "num_groups": (
        0,
        "Horovod's fusion buffer already batches the collectives",
        "tune HOROVOD_FUSION_THRESHOLD",
    ),
    "groups": (
        None,
        "Horovod's fusion buffer already batches the collectives",
        "tune HOROVOD_FUSION_THRESHOLD",
    ),
    "device_dense": (
        "",
        "the codecs run on the gradients' own device",
        "place the model's variables on the device",
    ),
    "device_sparse": (
        "",
        "the codecs run on the gradients' own device",
        "place the model's variables on the device",
    ),
    "name": (
        None,
        "the wrapper keeps the wrapped optimizer's name",
        "name the Keras optimizer itself",
    ),
}


def check_horovod_defaults(owner, **given):
    """Raises a ValueError, naming the keyword, for a keyword of Horovod's wrappers
    (``HOROVOD_DEFAULTS``) given anything but Horovod's default."""
    for name, value in given.items():
        default, why, instead = HOROVOD_DEFAULTS[name]
        if value != default or type(value) is not type(default):
            raise ValueError(
                f"{owner}: {name}={value!r} is not supported ({why}); {instead}, "
                f"or leave it at {default!r}"
            )


def check_global_membership(included, is_global, framework):
    """Refuses a rank outside Horovod's global process set, which holds every rank: it
    says so only when the process imported both ``horovod.torch`` and
    ``horovod.tensorflow``, whose process sets share one module that then answers for the
    other framework. Every compressed exchange would be skipped, silently."""
    if is_global and not included:
        raise RuntimeError(
            f"Horovod's global process set says this rank is not in it, so no gradient "
            f"would be exchanged: this process imported both horovod.torch and "
            f"horovod.tensorflow, whose process sets answer for the framework imported last. "
            f"Import only horovod.{framework} in a process that trains with it."
        )
