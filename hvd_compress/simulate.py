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


def two_level_step(codec, grads, nodes, uniforms=None, exchange="allgather", average=True):
    """What every worker holds after one two-level exchange of one tensor
    (``hvd_compress.topology``): each node's average, cut into L shards (zero-padded to
    equal lengths); shard l of every node through ``exchange_step`` among the M nodes'
    local ranks l; the decoded shards joined again.

    Args:
        grads: one float32 array per global rank, all of the same shape.
        nodes: the ``topology.Nodes`` the ranks sit on.
        uniforms: one array of uniform draws per global rank, each as long as a shard.
        exchange, average: as for ``exchange_step``; the average is over all ranks.

    On one node nothing crosses a network, so nothing is compressed: the result is the
    node's average.
    """
    shape = grads[0].shape
    numel = grads[0].size
    local_size = nodes.local_size
    length = nodes.shard_length(numel)
    padded = np.zeros(local_size * length, dtype=np.float32)
    node_means = []
    for ranks in nodes.ranks:
        total = np.zeros(local_size * length, dtype=np.float32)
        for rank in ranks:
            padded[:numel] = grads[rank].astype(np.float32).ravel()
            total += padded
        node_means.append(total / np.float32(local_size) if average else total)
    if nodes.cross_size == 1:
        return node_means[0][:numel].reshape(shape)
    shards = []
    for shard, ranks in enumerate(nodes.cross_sets()):
        cut = slice(shard * length, (shard + 1) * length)
        draws = None if uniforms is None else [uniforms[rank] for rank in ranks]
        vectors = [node_means[nodes.locate(rank)[0]][cut] for rank in ranks]
        shards.append(exchange_step(codec, vectors, draws, exchange, average))
    return np.concatenate(shards)[:numel].reshape(shape)
