"""Whether every rank was given the same compression configuration.

Ranks that disagree on the codec, the exchange or the parameters would start different
collectives and wait for each other forever (or sum codes that mean different things). The
ports gather one small description per rank when the optimizer is built, and every rank
raises the same error, naming what differs and on which ranks, before the first step.
"""


def describe(codec, exchange, average, parameters, bucket_bytes=0, adaptive=None):
    """A comparable description of one rank's configuration; ``parameters`` are
    (name, shape, dtype, reason) in the order the optimizer holds them, ``reason`` why the
    tensor is sent whole or ``"compressed"`` (``plan.plan_tensor``: the ``uncompressed``
    names, ``min_size``, the classifier decide it), ``bucket_bytes`` the size of its
    gradient buckets (``bucketing``), which decides their collectives, ``adaptive`` the
    adaptive mode's options (``adaptive.Adaptive``) or None, whose decisions and probes
    are collectives too. The optimizer adds its own modes (``modes``)."""
    return {
        "codec": repr(codec),
        "exchange": exchange,
        "average": average,
        "parameters": [
            (name, tuple(shape), str(dtype), reason) for name, shape, dtype, reason in parameters
        ],
        "bucket_bytes": bucket_bytes,
        "adaptive": repr(adaptive),
    }


def modes(**settings):
    """The optimizer's settings every rank must share, as ``describe`` adds them: those
    that decide when gradients are exchanged and how (``backward_passes_per_step``,
    ``sparse_as_dense``) or what the workers compute around the exchange (the worker
    momentum, compressed Adam), which a rank's own optimizer options can decide (a
    rank whose SGD has no momentum takes no worker momentum)."""
    return {"optimizer": dict(sorted(settings.items()))}


def disagreement(descriptions):
    """None if all ranks' descriptions are equal, else a message naming what differs."""
    problems = []
    for key in descriptions[0]:
        values = [d[key] for d in descriptions]
        if all(v == values[0] for v in values):
            continue
        if key == "parameters":
            values = [_first_difference(v, values[0]) for v in values]
        groups = {}  # each distinct value, and the ranks that have it
        for rank, value in enumerate(values):
            groups.setdefault(repr(value), (value, []))[1].append(rank)
        problems.append(
            f"{key}: "
            + "; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {value}"
                for value, ranks in groups.values()
            )
        )
    if not problems:
        return None
    return (
        "hvd_compress: the ranks were given different compression configurations, and "
        "would hang or sum codes that mean different things. Build the optimizer with the "
        "same compression, exchange, op, options and model on every rank. Differences:\n  "
        + "\n  ".join(problems)
    )


def _first_difference(parameters, reference):
    """This rank's parameter count and its first parameter that differs from rank 0's."""
    for index, (mine, theirs) in enumerate(zip(parameters, reference)):
        if mine != theirs:
            return f"{len(parameters)} parameters, #{index} is {mine}"
    return f"{len(parameters)} parameters"
