"""Elastic Horovod for Keras 3 models trained with ``hvd_compress.tf``'s wrappers.

Horovod 0.28.1's ``hvd.elastic.KerasState`` calls ``optimizer.variables()``, which Keras 3
made a list, so it raises on every Keras 3 model; and a step traced in one world keeps that
world's size. ``KerasState`` is the state to give ``hvd.elastic.run`` instead, with
Horovod's elastic Keras callbacks, which work on Keras 3::

    import horovod.tensorflow.keras as hvd
    import hvd_compress.tf as htf
    from hvd_compress.tf.elastic import KerasState

    hvd.init()
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                     compression="ef-sign"), loss=...)
    state = KerasState(model, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.CommitStateCallback(state)])

    train(state)

A loop of ``DistributedGradientTape`` steps gives the state its Keras optimizer and defines
its ``tf.function`` inside the function that ``hvd.elastic.run`` wraps, so that each world
traces its own (``docs/usage.md``, "Elastic Horovod").
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
from horovod.common.elastic import ObjectState
from horovod.tensorflow.functions import broadcast_object

from .tape import pipelines_over


def _tf_variables(variables):
    """The ``tf.Variable`` behind each of ``variables`` (Keras 3 wraps them)."""
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


class KerasState(ObjectState):
    """What ``hvd.elastic.run`` keeps of a Keras 3 model, its optimizer and the compression
    state, so that training survives workers that leave and join.

    - ``commit``/``save``: copies of the model's variables, the optimizer's (slots and
      ``iterations``) and the compression pipelines' (step counter, residuals, worker
      momentum), in memory; ``restore`` puts them back when a failed step is rolled back.
    - ``sync``, at the start and after every change of world: every rank takes rank 0's
      model and optimizer variables, and for a ``DistributedOptimizer`` its step counter and
      PowerSGD factors, which all ranks hold alike. Residuals and worker momentum stay each
      rank's own: they are its share of the average still to be sent. (A tape's pipeline
      is made at its first step, where the ranks take the largest step counter.)
    - ``reset``, after a change of world: each pipeline follows it (``ElasticWorld``: the
      residual mass of each worker that stays is carried into the new world, rescaled;
      the exchanges are made again for its size; the ranks agree again at the next step)
      and Keras traces ``fit``'s step again.

    The world must be Horovod's global process set and the exchanges flat (not
    ``"two-level"``, whose node process sets belong to the world it was built in).

    Args:
        model: a built Keras 3 model.
        optimizer: its ``hvd_compress.tf.DistributedOptimizer``, or the Keras optimizer that
            applies a ``DistributedGradientTape``'s gradients; default ``model.optimizer``.
            Built here on the model's trainable variables if it is not yet, so that every
            rank, a joining one too, holds the same variables.
        kwargs: further values to keep and sync (``epoch=0``, ``batch=0``), as attributes.
    """

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any):
        if not model.built:
            raise ValueError("KerasState: model must be built first (model.build(input_shape))")
        optimizer = optimizer if optimizer is not None else model.optimizer
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"KerasState: optimizer must be a Keras 3 optimizer (a "
                f"hvd_compress.tf.DistributedOptimizer, or the one that applies a "
                f"DistributedGradientTape's gradients), got {type(optimizer).__name__}"
            )
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer
        # A DistributedOptimizer's pipeline; a tape's are found as they are made.
        self._optimizer_pipeline = getattr(optimizer, "_hvdc_pipeline", None)
        for pipeline in self._pipelines():
            _check_elastic(pipeline)
        self._save_variables()
        super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank, **kwargs)

    def _pipelines(self):
        if self._optimizer_pipeline is not None:
            return [self._optimizer_pipeline]
        return pipelines_over(self.model.variables + _tf_variables(self.model.variables))

    def _keras_variables(self):
        """The model's and the optimizer's variables, which every rank holds alike."""
        return _tf_variables(self.model.variables + self.optimizer.variables)

    def _variables(self):
        """Every variable a step changes."""
        return self._keras_variables() + [v for p in self._pipelines() for v in p.variables]

    def _save_variables(self):
        self._saved = [(v, v.read_value()) for v in self._variables()]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in self._saved:
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        shared = []
        if self._optimizer_pipeline is not None:
            state = self._optimizer_pipeline.state
            shared = [state.step] + ([] if state.factors is None else list(state.factors.variables))
        hvd.broadcast_variables(self._keras_variables() + shared, root_rank=0)
        self._save_variables()
        super().sync()

    def reset(self) -> None:
        for pipeline in self._pipelines():
            _check_elastic(pipeline)
            pipeline.follow_world()
        # A new trace of fit's step, in which the ranks of the new world agree first.
        self.model.train_function = None


def _check_elastic(pipeline):
    """Refuses a pipeline that cannot follow a change of world."""
    if pipeline.process_set is not hvd.global_process_set:
        raise ValueError(
            "KerasState: elastic training takes the global process set; Horovod forgets "
            "other process sets when it re-initializes after a change of world"
        )
    if pipeline.nodes is not None:
        raise ValueError(
            'KerasState: exchange="two-level" keeps the node process sets of the world it '
            "was built in; elastic training takes the flat exchanges"
        )
