"""What a compression pipeline carries from one step to the next, in one object."""

from hvd_compress.adaptive import Planner
from hvd_compress.state import CommittedState

from .memory import ErrorFeedback, FactorMemory


class PipelineState(CommittedState):
    """Everything a ``CompressionPipeline`` keeps across steps, in one place, as
    ``PowerSGDState`` holds the state of PyTorch's PowerSGD hook: what ``state_dict`` saves,
    what a world that elastic Horovod changed adapts, and what a step commits
    (``CommittedState``: residuals, factors, worker momentum).

    Attributes:
        step: t, the steps exchanged so far. It seeds the random streams
            (``hvd_compress.seeding``), chooses CLT-k's leader and places the adaptive
            mode's decisions, so every rank holds the same one.
        planner: the adaptive mode's measurements and decisions (``adaptive.Planner``), or
            None.
    """

    def __init__(
        self,
        worker: ErrorFeedback | None = None,
        server: ErrorFeedback | None = None,
        factors: FactorMemory | None = None,
        planner: Planner | None = None,
    ):
        self.step = 0
        self.worker = worker
        self.server = server
        self.factors = factors
        self.planner = planner

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            **{role: part.state_dict() for role, part in self.committed().items()},
        }

    def place(self, placed) -> None:
        """Moves every tensor kept onto the device of the tensor it is kept for
        (``placed``, as ``load_state_dict`` takes it): after the model moved."""
        for part in self.committed().values():
            part.load_state_dict(part.state_dict(), placed)

    def load_state_dict(self, state: dict, placed) -> None:
        """Restores ``state``; ``placed`` moves a {name: tensor} onto the devices of the
        tensors named (``CompressionPipeline.placed``)."""
        self.step = int(state["step"])
        for role, part in self.committed().items():
            if role in state:
                part.load_state_dict(state[role], placed)
        if self.planner is not None:
            # Measurements are of this machine and job: a restored run warms up again.
            self.planner.restart(self.step)
