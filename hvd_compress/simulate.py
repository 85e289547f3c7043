"""N workers in one process: the numpy oracle that multi-process runs are checked against."""
import numpy as np

from .codes import IntCodes


def exchange_step(codec, grads, uniforms=None, exchange="allgather", average=True):
    """What every worker holds after one exchange of one tensor.

    Args:
        codec: a reference codec (``hvd_compress.TernGrad()``, ...).
        grads: one float32 array per worker, all of the same shape.
        uniforms: one array of uniform draws per worker, for stochastic codecs.
        exchange: ``"allreduce"``, ``"allgather"`` or ``"sharded"``.
        average: divide by the number of workers (Horovod's ``op=Average``) or not (``Sum``).
    """
    world = len(grads)
    shape = grads[0].shape
    flat = [g.astype(np.float32).ravel() for g in grads]
    draws = [None] * world if uniforms is None else [u.ravel() for u in uniforms]
    scale = None
    if codec.shares_scale:
        scale = max(codec.local_scale(g) for g in flat)
    codes = [codec.encode(g, scale, u) for g, u in zip(flat, draws)]
    if isinstance(codec.code_space, IntCodes):
        # Integer codes sum exactly, so every exchange delivers the same total.
        total = np.sum(np.stack(codes).astype(np.int64), axis=0)
    elif exchange == "sharded":
        # The summed shards are rounded to the code dtype again before the allgather.
        total = np.sum(np.stack(codes).astype(np.float32), axis=0).astype(codes[0].dtype)
    else:
        total = np.sum(np.stack(codes).astype(np.float32), axis=0)
    return codec.decode(total, scale, world if average else 1).reshape(shape)
