"""Error-feedback memory: what a compressed message did not carry, kept for the next one."""

import torch


def choose(keep, new, old):
    """``new`` where the boolean 0-d tensor ``keep`` holds, else ``old``, without reading
    ``keep`` (on a GPU a read waits for the device). None stands for zeros: no residual yet,
    or one the step sent whole; it stays None only if both are."""
    if new is None:
        return None if old is None else torch.where(keep, 0.0, old)
    return torch.where(keep, new, 0.0 if old is None else old)


class ErrorFeedback:
    """Residuals keyed by tensor name (parameter names, and shard names on a server).

    ``compensate`` adds the residual to a new vector; ``update`` keeps the part of it the
    message did not carry. Nothing is lost: the sum of all messages plus the residual equals
    the sum of all vectors (``tests`` check this telescoping identity).

    Residuals are kept in the units of the vectors. When those are gradients that the
    optimizer multiplies by a learning rate eta_t (dist-EF-blockSGD's lr-free form), a residual
    made at eta_{t-1} must enter step t scaled by eta_{t-1} / eta_t: ``compensate`` takes that
    ratio (``lr_ratio``).

    ``update`` only proposes the new residual; ``commit`` keeps or drops every proposal of the
    step at once. The pipeline commits when all exchanged gradients of the step are finite and
    drops them otherwise: a NaN or Inf on any rank makes every rank's averaged gradient
    non-finite, a ``GradScaler`` skips that step everywhere, and the residuals from before it
    stay, identical on every rank. Where the step's finiteness is a tensor on the device,
    ``commit`` selects each residual by it instead of reading it (``choose``): a residual the
    step sent whole then stays as zeros rather than going.
    """

    def __init__(self):
        self.residuals = {}
        self.proposed = {}

    def compensate(self, name, vector, lr_ratio=1.0):
        residual = self.residuals.get(name)
        if residual is None:
            return vector
        # An lr_ratio of 1 (constant learning rate) saves a pass over the residual. A tensor
        # lr_ratio (learning rates kept on the device, ``WorkerMomentum.commit``) is not read.
        if not isinstance(lr_ratio, torch.Tensor) and lr_ratio == 1.0:
            return vector + residual
        return vector + residual * lr_ratio

    def update(self, name, compensated, sent, beta=1.0):
        """Proposes ``compensated - sent`` as the new residual; with ``beta`` < 1 a low-pass
        filtered one, (1 - beta) residual + beta (compensated - sent) (ScaleCom)."""
        self._propose_filtered(name, compensated - sent, beta)

    def update_unsent(self, name, compensated, indices, beta=1.0):
        """``update`` for a message that carried the flat ``compensated`` exactly at
        ``indices`` (int64, distinct) and nothing elsewhere, as top-k does: the residual is
        ``compensated`` with zeros there, without a dense copy of the message to subtract."""
        self._propose_filtered(name, compensated.index_fill(0, indices, 0.0), beta)

    def _propose_filtered(self, name, residual, beta):
        if beta != 1.0:
            previous = self.residuals.get(name)
            residual = (
                residual * beta if previous is None else previous * (1.0 - beta) + residual * beta
            )
        self.propose(name, residual)

    def flush(self, name, vector, lr_ratio=1.0):
        """``vector`` plus the residual, which the step then drops: for a tensor that is sent
        whole, so that the residual reaches the others instead of being lost."""
        compensated = self.compensate(name, vector, lr_ratio)
        self.proposed[name] = None
        return compensated

    def propose(self, name, residual):
        """Proposes ``residual`` itself, made by a caller that fused the compensation,
        the message and the subtraction (``fused``)."""
        self.proposed[name] = residual

    def commit(self, keep):
        """Keeps (``keep``: a bool, or a boolean 0-d tensor) or drops the step's proposals."""
        if isinstance(keep, torch.Tensor):
            for name, residual in self.proposed.items():
                chosen = choose(keep, residual, self.residuals.get(name))
                if chosen is not None:
                    self.residuals[name] = chosen
        elif keep:
            for name, residual in self.proposed.items():
                if residual is None:
                    self.residuals.pop(name, None)
                else:
                    self.residuals[name] = residual
        self.proposed = {}

    def state_dict(self):
        return {name: residual.clone() for name, residual in self.residuals.items()}

    def load_state_dict(self, state, placed):
        """Restores ``state`` through ``placed``, which copies its tensors onto their devices."""
        self.residuals = placed(state)


class FactorMemory(ErrorFeedback):
    """PowerSGD's factors Q by tensor name, kept from step to step to warm-start the next
    power iteration. A step proposes them and commits them with its residuals, so a step
    skipped for a non-finite gradient keeps the factors from before it; ``residuals`` holds
    them, starting from ``initial`` ({name: Q})."""

    def __init__(self, initial):
        super().__init__()
        self.residuals = dict(initial)
