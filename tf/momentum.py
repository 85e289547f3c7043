"""dist-EF-blockSGDM's worker-side momentum (Zheng et al., NeurIPS 2019, Algorithm 2 and the
authors' code), as an optimizer mode of ``DistributedOptimizer`` over
``keras.optimizers.SGD``.

Per variable, with mu = the optimizer's momentum and eta_t its learning rate:

    before the exchange:  m = mu m + g;  u = g + mu m  (Nesterov's form, the optimizer's or
                          the mode's; u = m in heavy-ball's)
                          the residuals enter as u + (eta_{t-1} / eta_t) e
    after the exchange:   Delta~ = the decoded server message (gradient units)
                          x -= eta_t wd x;  x -= eta_t Delta~

Weight decay stays out of compression. Keras's ``weight_decay`` is decoupled (x -= eta_t wd x,
without momentum), so the base SGD step keeps applying it as Keras SGD does; the PyTorch port
instead keeps a second momentum buffer for it, because ``torch.optim.SGD`` puts wd x through
its momentum. The base step runs with momentum switched off, so no momentum is applied twice.
Learning-rate schedules are seen through ``optimizer.learning_rate``.
"""

import contextlib
import dataclasses
import sys

import keras
import tensorflow as tf

from .memory import assign_if


def keras2_class(name):
    """``tf_keras.optimizers.<name>`` where the program uses Keras 2 (``tf_keras`` is
    imported), else None: only code that imported ``tf_keras`` makes its optimizers."""
    tf_keras = sys.modules.get("tf_keras")
    return None if tf_keras is None else getattr(tf_keras.optimizers, name)


class WorkerMomentum(tf.Module):
    """The momentum buffers m (``tf.Variable``\\ s in gradient units, saved by
    ``tf.train.Checkpoint`` with the optimizer) and eta of the last exchange, for the
    variables of ``pipeline`` in its order; committed with the pipeline's residuals."""

    @dataclasses.dataclass
    class Deferred:
        """One gradient's momentum step, left to the pipeline's fused compensation
        (``fused.compensated_scale``), which sets the new m as ``out``."""

        buffer: tf.Tensor  # m
        mu: float
        nesterov: bool
        out: tf.Tensor = None

    def __init__(self, pipeline, nesterov=False):
        super().__init__(name="worker_momentum")
        # Nesterov's form whatever the optimizer says (worker_momentum="nesterov")
        self.nesterov = nesterov
        with tf.init_scope():
            self.momentum = {
                plan.name: tf.Variable(tf.zeros(shape, dtype), trainable=False, name="momentum")
                for plan, shape, dtype in zip(pipeline.plans, pipeline.shapes, pipeline.dtypes)
            }
            # 0 until the first exchange, which has no earlier rate to rescale from.
            self.learning_rate = tf.Variable(0.0, trainable=False, name="learning_rate")
        self.names = [plan.name for plan in pipeline.plans]
        # (name -> m, eta) of the step in flight, kept by ``commit`` only if the step's
        # gradients are finite everywhere (the pipeline decides, like its residuals).
        self.proposed = {}
        pipeline.state.momentum = self

    def mask(self, name, indices):
        """Forgets the proposed momentum of tensor ``name`` at ``indices`` (int64, [k, 1]),
        which its exchange sent (DGC's momentum factor masking)."""
        buffer = self.proposed["momentum"].get(name)
        if buffer is not None:
            flat = tf.reshape(buffer, [-1])
            zeros = tf.zeros(tf.shape(indices)[:1], flat.dtype)
            self.proposed["momentum"][name] = tf.reshape(
                tf.tensor_scatter_nd_update(flat, indices, zeros), tf.shape(buffer)
            )

    @staticmethod
    def is_sgd(optimizer):
        """Whether ``optimizer`` is Keras's SGD, of Keras 3 or of Keras 2 (``tf_keras``,
        whose SGD reads ``momentum`` and ``nesterov`` alike)."""
        keras2 = keras2_class("SGD")
        return isinstance(optimizer, keras.optimizers.SGD) or (
            keras2 is not None and isinstance(optimizer, keras2)
        )

    @classmethod
    def takes(cls, optimizer):
        """Whether ``optimizer`` is an SGD with momentum, for which ef-sign's default mode
        is this one."""
        return cls.is_sgd(optimizer) and optimizer.momentum > 0

    @classmethod
    def check(cls, optimizer):
        if not cls.is_sgd(optimizer):
            raise TypeError(
                f"worker_momentum needs a keras.optimizers.SGD, got {type(optimizer).__name__}"
            )

    def before_exchange(self, optimizer, grads, defer=None):
        """The momentum directions u for ``grads`` (in the pipeline's order; None stays None),
        eta_{t-1} / eta_t, and per gradient a ``Deferred`` or None. Where ``defer`` (one
        boolean per gradient: the pipeline's ``fuses``) holds, the step is left to the
        pipeline's fused compensation: the direction is the gradient itself and its
        ``Deferred`` carries the step."""
        mu, rate = optimizer.momentum, tf.cast(optimizer.learning_rate, tf.float32)
        nesterov = self.nesterov or optimizer.nesterov
        defer = defer or [False] * len(grads)
        directions, buffers, deferred = [], {}, []
        for name, grad, later in zip(self.names, grads, defer):
            step = None
            if grad is not None and mu != 0:
                grad = tf.convert_to_tensor(grad)
                if later:
                    step = buffers[name] = self.Deferred(
                        tf.convert_to_tensor(self.momentum[name]), mu, nesterov
                    )
                else:
                    buffer = buffers[name] = self.momentum[name] * mu + grad
                    grad = grad + buffer * mu if nesterov else buffer
            directions.append(grad)
            deferred.append(step)
        self.proposed = {"momentum": buffers, "learning_rate": rate}
        previous = self.learning_rate
        return directions, tf.where(previous > 0, previous / rate, 1.0), deferred

    def commit(self, keep):
        buffers = {
            name: buffer.out if isinstance(buffer, self.Deferred) else buffer
            for name, buffer in self.proposed["momentum"].items()
        }
        assign_if(
            keep,
            [(self.momentum[name], buffer) for name, buffer in buffers.items()]
            + [(self.learning_rate, self.proposed["learning_rate"])],
        )
        self.proposed = {}

    @staticmethod
    @contextlib.contextmanager
    def applied_by_worker(optimizer):
        """Lets the base SGD step run as plain SGD (with Keras's decoupled weight decay) on
        the exchanged directions. Keras reads ``momentum`` and ``nesterov`` when it builds
        the update (eagerly, or while tracing), so switching them around it suffices."""
        mu, nesterov = optimizer.momentum, optimizer.nesterov
        optimizer.momentum, optimizer.nesterov = 0.0, False
        try:
            yield
        finally:
            optimizer.momentum, optimizer.nesterov = mu, nesterov
