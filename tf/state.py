"""What a compression pipeline carries from one step to the next, in one object."""

import tensorflow as tf

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

    The PyTorch port's state also holds the adaptive mode's planner; that mode is the
    PyTorch port's only.
    """

    aggregation = None

    def __init__(
        self,
        step: tf.Variable,
        worker: ErrorFeedback | None = None,
        server: ErrorFeedback | None = None,
        factors: FactorMemory | None = None,
    ):
        super().__init__(name="state")
        self.step = step
        self.worker = worker
        self.server = server
        self.factors = factors
