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
    count = world if average else 1
    shape = grads[0].shape
    flat = [g.astype(np.float32).ravel() for g in grads]
    draws = [None] * world if uniforms is None else [u.ravel() for u in uniforms]
    scales = [None] * world
    if codec.scaled:
        scales = [codec.local_scale(g) for g in flat]
        if codec.shares_scale(exchange):
            scales = [np.max(np.stack(scales), axis=0)] * world
    codes = [codec.encode(g, s, u) for g, s, u in zip(flat, scales, draws)]
    if codec.scaled and not codec.shares_scale(exchange):
        # Each worker's codes are decoded under its own scales, then summed.
        values = np.stack([codec.values(c) for c in codes])
        result = codec.decode(values, np.stack(scales), count).sum(axis=0)
    elif isinstance(codec.code_space, IntCodes):
        # Integer values sum exactly, so every exchange delivers the same total.
        total = np.sum(np.stack([codec.values(c) for c in codes]).astype(np.int64), axis=0)
        result = codec.decode(total, scales[0], count)
    else:
        total = np.sum(np.stack(codes).astype(np.float32), axis=0)
        if exchange == "sharded":
            # The summed shards are rounded to the code dtype again before the allgather.
            total = total.astype(codes[0].dtype)
        result = codec.decode(total, scales[0], count)
    return result.reshape(shape)
