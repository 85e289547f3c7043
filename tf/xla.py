"""XLA and the wrappers: Horovod's collectives have no XLA kernels (this library's Horovod is
built without ``HOROVOD_ENABLE_XLA_OPS``), so a step that exchanges gradients must run
outside XLA.

Keras 3 compiles ``model.fit``'s step with XLA by default wherever a GPU is present
(``jit_compile="auto"``). For a model compiled with one of this library's optimizers, the
wrappers make ``"auto"`` resolve to no XLA and say so once; ``jit_compile=True`` asked for
explicitly is refused at the first step (``refuse_xla``). The PyTorch port has no twin: torch
compiles nothing unless asked.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from hvd_compress.remedies import log_once


def refuse_xla(owner: str) -> None:
    """Raises a ValueError, naming ``owner``, where the graph being built is XLA-compiled,
    which would otherwise fail with TensorFlow's "tf2xla conversion failed"."""
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"{owner}: XLA cannot compile Horovod's collectives; compile the model with "
            f"jit_compile=False or leave it at its default ('auto', which the wrappers "
            f"resolve to no XLA), or call it from a tf.function without jit_compile=True"
        )


def leave_auto_xla_off() -> None:
    """Makes Keras 3 resolve ``jit_compile="auto"`` to False for models whose optimizer is
    one of this library's wrappers (a class attribute ``_hvdc_owner`` names it), and to what
    Keras would choose for any other model. Idempotent; a Keras without the method it
    replaces keeps its own choice, and an XLA step is then refused by ``refuse_xla``."""
    resolve = getattr(keras.Model, "_resolve_auto_jit_compile", None)
    if resolve is None or getattr(resolve, "hvdc_leaves_xla_off", False):
        return

    def resolve_auto_jit_compile(model):
        optimizer = getattr(model, "optimizer", None)
        # A mixed-precision model's optimizer is Keras's LossScaleOptimizer around the user's.
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        owner = getattr(optimizer, "_hvdc_owner", None)
        if owner is None or not resolve(model):
            return resolve(model)
        log_once(
            f"hvd_compress: {owner} leaves XLA off for model.fit's step, which Keras turns "
            f"on by default here (jit_compile='auto'): XLA cannot compile Horovod's "
            f"collectives. The rest of the model's step runs as TensorFlow graphs."
        )
        return False

    resolve_auto_jit_compile.hvdc_leaves_xla_off = True
    keras.Model._resolve_auto_jit_compile = resolve_auto_jit_compile
