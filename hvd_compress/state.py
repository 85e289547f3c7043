"""The state a compression pipeline commits at the end of each step, shared by both ports'
``PipelineState``."""


class CommittedState:
    """The parts of a pipeline's state that a step only proposes, and keeps only if its
    exchanged gradients are finite on every rank: a NaN or Inf anywhere makes every rank's
    average non-finite, the step is skipped everywhere, and what was there before it stays,
    identical on every rank. Each part, if not None, has ``commit(keep)``.

    Attributes:
        worker: e_t, the worker residual of each compressed tensor (``ErrorFeedback``), or
            None without error feedback.
        server: two-way codecs' server residual of each tensor or shard (ef-sign's e~_t),
            or None.
        factors: low-rank codecs' factor Q of each tensor (``FactorMemory``), or None.
        momentum: dist-EF-blockSGDM's worker momentum m (``WorkerMomentum``), which the
            optimizer that applies it sets, or None. Exchanges that send part of the
            velocity (DGC's) make it forget what they sent.
    """

    worker = server = factors = momentum = None

    def committed(self) -> dict:
        """The parts that are kept, by their role (the keys of PyTorch's ``state_dict``)."""
        parts = {
            "worker": self.worker,
            "server": self.server,
            "factors": self.factors,
            "momentum": self.momentum,
        }
        return {role: part for role, part in parts.items() if part is not None}

    def commit(self, keep) -> None:
        """Keeps (``keep``: a bool, or a boolean tensor: in TensorFlow one of the step's
        graph, in PyTorch a 0-d one on the device, which the parts select by without reading
        it) or drops every change the step proposed."""
        for part in self.committed().values():
            part.commit(keep)
