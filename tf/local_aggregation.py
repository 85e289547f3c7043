"""Local gradient aggregation in the Keras optimizer, Horovod's ``backward_passes_per_step``:
a common way to grow the batch without more memory per worker.

Each ``apply`` adds its gradients to this worker's sums; every ``backward_passes_per_step``-th
one exchanges the sums (or their mean, ``average_aggregated_gradients``) and applies them, and
the others only advance the optimizer's iteration counter, as Horovod's
``LocalGradientAggregationHelper`` does, so learning-rate schedules count passes. The PyTorch
port has no twin: torch sums backward passes into ``.grad`` itself, and its
``backward_passes_per_step`` only says which pass's hooks exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


class LocalAggregation(tf.Module):
    """The sums of the passes since the last exchange, one per variable, and how many.

    Args:
        variables: the optimizer's variables, in the order of the gradients ``apply`` takes.
        keys: a key per variable (the optimizer's ``_var_key``).
        passes: k = ``backward_passes_per_step`` >= 2.
        average: divide the sums by k before the exchange.
    """

    def __init__(self, variables: list, keys: list, passes: int, average: bool) -> None:
        super().__init__(name="aggregation")
        self.passes, self.average = passes, average
        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="count")
            self.sums = {
                key: tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="sum")
                for key, v in zip(keys, variables)
            }

    def apply(
        self,
        grads: list,
        keys: list,
        exchange_and_apply: Callable[[list], Any],
        skip: Callable[[], Any],
    ) -> None:
        """Adds ``grads`` (of the variables ``keys``) to the sums; on every k-th pass calls
        ``exchange_and_apply`` with the sums (None where this pass's gradient is None) and
        clears them, on the others ``skip``."""
        added = [
            None if g is None else self.sums[key].assign_add(tf.convert_to_tensor(g))
            for key, g in zip(keys, grads)
        ]
        count = self.count.assign_add(1)

        def exchange():
            scale = 1.0 / self.passes if self.average else 1.0
            exchange_and_apply([None if a is None else a * scale for a in added])
            for total in self.sums.values():
                total.assign(tf.zeros_like(total))
            self.count.assign(0)

        def wait():
            skip()

        tf.cond(count >= self.passes, exchange, wait)
