"""Error-feedback memory: what a compressed message did not carry, kept for the next one."""

import tensorflow as tf


def assign_if(keep, assignments):
    """Assigns each (variable, value) pair of ``assignments`` where ``keep`` (a boolean,
    may be a tensor) holds, and nothing otherwise: one ``tf.cond`` rather than a
    ``tf.where`` per variable, which would read the old and the new value of every element
    on every step (a variable adopts a kept value's buffer instead of copying it)."""

    def assign():
        for variable, value in assignments:
            variable.assign(value)

    tf.cond(keep, assign, lambda: None)


class ErrorFeedback(tf.Module):
    """Residuals keyed by tensor name (parameter names, and shard names on a server).

    ``compensate`` adds the residual to a new vector; ``update`` keeps the part of it the
    message did not carry. Nothing is lost: the sum of all messages plus the residual equals
    the sum of all vectors.

    The residuals are ``tf.Variable``\\ s made up front (zeros, which compensate nothing), so
    that a ``tf.function`` can update them and ``tf.train.Checkpoint`` saves them with the
    module that owns this one.

    Residuals are kept in the units of the vectors. When those are gradients that the
    optimizer multiplies by a learning rate eta_t, a residual made at eta_{t-1} must enter
    step t scaled by eta_{t-1} / eta_t: ``compensate`` takes that ratio (``lr_ratio``).

    ``update`` only proposes the new residual; ``commit`` keeps or drops every proposal of the
    step at once. The pipeline commits when all exchanged gradients of the step are finite and
    drops them otherwise: a NaN or Inf on any rank makes every rank's averaged gradient
    non-finite, such a step is skipped everywhere, and the residuals from before it stay,
    identical on every rank. ``keep`` may be a tensor (inside a ``tf.function``).

    Args:
        sizes: {name: number of elements} of the residuals to keep.
        name: the module's name.
    """

    def __init__(self, sizes, name=None):
        super().__init__(name=name)
        with tf.init_scope():
            self.residuals = {
                key: tf.Variable(tf.zeros([numel]), trainable=False, name="residual")
                for key, numel in sizes.items()
            }
        self.proposed = {}

    def compensate(self, name, vector, lr_ratio=1.0):
        return vector + self.residuals[name] * lr_ratio

    def update(self, name, compensated, sent, beta=1.0):
        """Proposes ``compensated - sent`` as the new residual; with ``beta`` < 1 a low-pass
        filtered one, (1 - beta) residual + beta (compensated - sent) (ScaleCom)."""
        self._propose_filtered(name, compensated - sent, beta)

    def update_unsent(self, name, compensated, indices, beta=1.0):
        """``update`` for a message that carried the flat ``compensated`` exactly at
        ``indices`` (int64, [k, 1], distinct) and nothing elsewhere, as top-k does: the
        residual is ``compensated`` with zeros there, without a dense copy of the message to
        subtract."""
        zeros = tf.zeros(tf.shape(indices)[:1], compensated.dtype)
        self._propose_filtered(name, tf.tensor_scatter_nd_update(compensated, indices, zeros), beta)

    def _propose_filtered(self, name, residual, beta):
        if beta != 1.0:
            residual = self.residuals[name] * (1.0 - beta) + residual * beta
        self.propose(name, residual)

    def propose(self, name, residual):
        """Proposes ``residual`` itself as the new value of ``name``."""
        self.proposed[name] = residual

    def commit(self, keep):
        assign_if(keep, [(self.residuals[name], value) for name, value in self.proposed.items()])
        self.proposed = {}


class FactorMemory(ErrorFeedback):
    """PowerSGD's factors Q by tensor name, kept from step to step to warm-start the next
    power iteration. A step proposes them and commits them with its residuals, so a step
    skipped for a non-finite gradient keeps the factors from before it; ``residuals`` holds
    them, as variables starting from ``initial`` ({name: Q})."""

    def __init__(self, initial, name=None):
        super().__init__({}, name=name)
        with tf.init_scope():
            self.residuals = {
                key: tf.Variable(value, trainable=False, name="factor")
                for key, value in initial.items()
            }
