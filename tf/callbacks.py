"""Keras callbacks for data-parallel training with ``hvd_compress.tf.DistributedOptimizer``:
the same start on every rank, and metrics averaged over ranks."""

import horovod.tensorflow as hvd
import keras
import tensorflow as tf


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` when training
    begins, so every rank starts from the same weights (also after only the root loaded a
    checkpoint).

    Keras 3 builds the optimizer before ``on_train_begin``, so its slots and the compression
    state (the step counter, which positions the random streams, and error-feedback
    residuals) exist and are broadcast with the weights, before the first step rather than
    after it as in ``horovod.tensorflow.keras``.

    Args:
        root_rank (int): the rank whose variables every rank takes. Default 0.
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        optimizer = self.model.optimizer
        variables = [
            v.value if isinstance(v, keras.Variable) else v
            for v in self.model.variables + optimizer.variables
        ]
        variables += getattr(optimizer, "compression_variables", [])
        hvd.broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every epoch metric in ``logs`` with its average over ranks (each rank sees
    only its shard of the data). Put it before callbacks that read the metrics
    (``ReduceLROnPlateau``, ``EarlyStopping``, ``ModelCheckpoint``, loggers)."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        for key in sorted(logs):  # the same order of collectives on every rank
            value = tf.constant(logs[key], tf.float64)
            logs[key] = float(hvd.allreduce(value, op=hvd.Average, name=f"hvdc.metric.{key}"))
