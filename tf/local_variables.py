"""Variables whose gradients stay on their worker: Horovod's ``register_local_source`` (tape)
and ``register_local_var`` (Keras optimizer), for model-parallel layouts where each rank
trains a part of the model of its own.

The exchange plans and compresses the other variables only; a local variable's gradient
comes back as the rank computed it, divided by the process set's size when
``scale_local_gradients`` (Horovod's default, which keeps a local variable's step in
proportion to the averaged ones; horovod/horovod#3695). The PyTorch port has no twin: its
wrappers exchange exactly the parameters named to them, so a local parameter is one left out.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_compress.validation import check_bool


class LocalVariables:
    """The variables (or watched tensors) registered as local, and how their gradients are
    returned."""

    def __init__(self, owner: str, scale_local_gradients: bool) -> None:
        self.scale = check_bool(owner, "scale_local_gradients", scale_local_gradients)
        # By identity, as Horovod's ``ref()``s, for Keras 3 variables too; the sources are
        # kept so that their ids are never reused.
        self._sources: dict[int, Any] = {}

    def register(self, source: Any) -> None:
        self._sources[id(source)] = source

    def __contains__(self, source: Any) -> bool:
        return id(source) in self._sources

    def __bool__(self) -> bool:
        return bool(self._sources)

    def gradient(self, grad: Any, world_size: int) -> Any:
        """A local variable's gradient as the wrapper returns it."""
        if grad is None or not self.scale:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / world_size, grad.indices, grad.dense_shape)
        return grad / world_size
