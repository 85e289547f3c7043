"""The server's half of two-way compression, in codec and memory calls only, so that every
framework port runs the same step on its own tensors."""


class ServerStep:
    """The server's half of two-way compression (dist-EF-blockSGD): the averaged messages
    plus the server residual are compressed again, and what that leaves out is kept.

    Args:
        memory: the server's ``ErrorFeedback`` (of the port).
        key: the residual's name (the tensor's, or its shard's in the sharded exchange).
        lr_ratio: eta_{t-1} / eta_t for residuals kept in gradient units.
    """

    def __init__(self, memory, key, lr_ratio=1.0):
        self.memory, self.key, self.lr_ratio = memory, key, lr_ratio

    def __call__(self, codec, average):
        """Returns the server message's codes, scales and decoded value."""
        compensated = self.memory.compensate(self.key, average, self.lr_ratio)
        scale = codec.local_scale(compensated)
        codes = codec.encode(compensated, scale, None)
        sent = codec.decode(codec.values(codes), scale, 1)
        self.memory.update(self.key, compensated, sent)
        return codes, scale, sent
