"""The float64 reference of compressed Adam's stage after the freeze, shared by the PyTorch
and TensorFlow tests (``pt/compressed_adam.py``, ``tf/compressed_adam.py``).

A run's record, per rank: ``names`` (the parameters, in order), and per step ``grads``,
``m`` and ``v`` (name -> this rank's local gradient and the optimizer's moments after the
step, numpy) and ``params`` (all parameters after the step, flattened in ``names`` order);
at the end ``worker`` and ``server`` (name -> residual, absent for tensors sent whole).
"""

import numpy as np

WARMUP = 4  # T_w
LR, BETA1, BETA2, EPS, DECAY = 1e-2, 0.9, 0.999, 1e-8, 0.1
BOUND = max(1.0, (1 - BETA1) / (1 - BETA2) ** 0.5)  # c


def denominator(v):
    """d = sqrt(v / (1 - beta2^T_w)) + eps of the frozen v, in float32 as the ports make it."""
    v = np.asarray(v, np.float32)
    return (np.sqrt(v) / np.float32((1 - BETA2**WARMUP) ** 0.5) + np.float32(EPS)).astype(
        np.float64
    )


def _mean_normalised(grads, m, d):
    """mean_i clip((beta1 m + (1 - beta1) g_i) / d, +-c) over the ranks' ``grads``, in
    float64."""
    return np.mean(
        [
            np.clip((BETA1 * m + (1 - BETA1) * g.astype(np.float64)) / d, -BOUND, BOUND)
            for g in grads
        ],
        axis=0,
    )


def frozen_variance_replay(records):
    """The parameters after each step past T_w with an exact exchange: u = the mean of the
    ranks' u_i, m = u d, x = x (1 - eta lambda) - eta / (1 - beta1^t) u, from the run's state
    at the freeze (every parameter decayed, as in the tests' optimizers)."""
    first, names = records[0], records[0]["names"]
    sizes = [first["m"][0][name].size for name in names]
    start = first["params"][WARMUP - 1].astype(np.float64)
    x = dict(zip(names, np.split(start, np.cumsum(sizes)[:-1])))
    m = {n: first["m"][WARMUP - 1][n].astype(np.float64).ravel() for n in names}
    d = {n: denominator(first["v"][WARMUP - 1][n]).ravel() for n in names}
    params = []
    for step in range(WARMUP, len(first["grads"])):
        t = step + 1
        for n in names:
            u = _mean_normalised([r["grads"][step][n].ravel() for r in records], m[n], d[n])
            m[n] = u * d[n]
            x[n] = x[n] * (1 - LR * DECAY) - LR / (1 - BETA1**t) * u
        params.append(np.concatenate([x[n] for n in names]))
    return params


def momentum_error_feedback_gap(records):
    """max over compressed tensors of | sum_{t > T_w} (mean_i u_t,i - u_t) - (mean_i e_T,i +
    e~_T) | / | sum mean_i u_t,i |, u = m / d: the normalised momentum each worker meant to
    send, less what the exchanges delivered, is what the worker and server residuals hold."""
    first, gaps = records[0], []
    for name in first["names"]:
        if name not in first["worker"]:
            continue  # sent whole
        d = denominator(first["v"][WARMUP - 1][name]).ravel()
        meant = delivered = 0
        for step in range(WARMUP, len(first["grads"])):
            previous = first["m"][step - 1][name].astype(np.float64).ravel()
            grads = [r["grads"][step][name].ravel() for r in records]
            meant = meant + _mean_normalised(grads, previous, d)
            delivered = delivered + first["m"][step][name].astype(np.float64).ravel() / d
        worker = np.mean([r["worker"][name].astype(np.float64) for r in records], axis=0)
        server = first["server"].get(name)
        if server is None:
            server = np.zeros_like(worker)
        elif server.size < worker.size:  # sharded: each rank holds its shard
            server = np.concatenate([r["server"][name] for r in records])[: worker.size]
        gap = np.abs((meant - delivered) - (worker + server)).max() / np.abs(meant).max()
        gaps.append(float(gap))
    assert gaps, "no tensor was compressed"
    return max(gaps)
