"""What a compression pipeline carries from one step to the next, in one object."""

import tensorflow as tf

from hvd_compress.adaptive import Planner
from hvd_compress.state import CommittedState

from .memory import ErrorFeedback, FactorMemory


class PipelineState(CommittedState, tf.Module):
    """Everything a ``CompressionPipeline`` keeps across steps, in one place, as
    ``PowerSGDState`` holds the state of PyTorch's PowerSGD hook: ``tf.Variable``\\ s that
    ``tf.train.Checkpoint`` saves with the pipeline, and what a step commits
    (``CommittedState``: residuals, factors, worker momentum).

    Attributes:
        step: t, the steps exchanged so far (an int64 variable). It seeds the random
            streams (``hvd_compress.seeding``) and chooses CLT-k's leader, so every rank
            holds the same one.

        aggregation: the Keras optimizer's sums of the backward passes since its last
            exchange (``LocalAggregation``), with ``backward_passes_per_step`` > 1; else
            None. Not committed: a pass adds to it whatever its gradients.

        planner: the adaptive mode's measurements and decisions (``adaptive.Planner``), or
            None without the mode. Not saved: a restored job warms up again.
        paths: with a planner, each tensor's path in force (an int32 variable, per name of
            ``planner.compressible``, the index of its path in ``adaptive.PATHS``): the
            planner's, which the traced step reads (``AdaptiveSteps.follow_paths``).
    """

    aggregation = None
    planner = paths = None

    def __init__(
        self,
        step: tf.Variable,
        worker: ErrorFeedback | None = None,
        server: ErrorFeedback | None = None,
        factors: FactorMemory | None = None,
        planner: Planner | None = None,
    ):
        super().__init__(name="state")
        self.step = step
        self.worker = worker
        self.server = server
        self.factors = factors
        if planner is not None:
            self.planner = planner
            with tf.init_scope():
                self.paths = tf.Variable(
                    tf.zeros([len(planner.compressible)], tf.int32), trainable=False, name="paths"
                )
