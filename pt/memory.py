"""Error-feedback memory: what a compressed message did not carry, kept for the next one."""
import torch


class ErrorFeedback:
    """Residuals keyed by tensor name (parameter names, and shard names on a server).

    ``compensate`` adds the residual to a new vector; ``update`` keeps the part of it the
    message did not carry. Nothing is lost: the sum of all messages plus the residual equals
    the sum of all vectors (``tests`` check this telescoping identity).

    Residuals are kept in the units of the vectors. When those are gradients that the
    optimizer multiplies by a learning rate eta_t (dist-EF-blockSGD's lr-free form), a residual
    made at eta_{t-1} must enter step t scaled by eta_{t-1} / eta_t: ``compensate`` takes that
    ratio.

    A residual is never made from a non-finite vector: such a step is skipped by every rank
    (``GradScaler``), and the residual from before it is kept.
    """

    def __init__(self):
        self.residuals = {}

    def compensate(self, name, vector, ratio=1.0):
        residual = self.residuals.get(name)
        if residual is None:
            return vector
        return vector + residual * ratio

    def update(self, name, compensated, sent):
        residual = compensated - sent
        finite = torch.isfinite(residual).all()
        previous = self.residuals.get(name)
        if previous is None:
            previous = torch.zeros_like(residual)
        self.residuals[name] = torch.where(finite, residual, previous)

    def state_dict(self):
        return {name: residual.clone() for name, residual in self.residuals.items()}

    def load_state_dict(self, state):
        self.residuals = {name: residual.clone() for name, residual in state.items()}
