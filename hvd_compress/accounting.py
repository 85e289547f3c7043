"""Byte accounting shared by both ports: the bytes a step's wire formats predict, and the
per-layer-kind statistics of ``compression_stats()``.

Each port describes its tensors in the same terms (``Sent``) and leaves the arithmetic here,
so that what a PyTorch and a TensorFlow job report for the same model and codec is computed
by one function.
"""

import collections
from dataclasses import dataclass

from . import cost

# How a tensor travels when no codec carries it: Horovod's allreduce, whole (in its own
# dtype) or, in the PyTorch adaptive mode, in float16.
UNCOMPRESSED = "allreduce (uncompressed)"
HALF = "allreduce (fp16)"


@dataclass
class Sent:
    """One tensor of a step, as the accounting needs it."""

    name: str
    layer: str  # its layer kind (``codec.layer_kind``)
    numel: int
    itemsize: int  # bytes per element of the gradient
    route: str  # UNCOMPRESSED, HALF or the codec's exchange
    reason: str  # why it is, or is not, compressed
    bytes_handed: int = 0  # handed to Horovod for it last step
    sent_elements: int = None  # elements its codec sent last step (None: all)


def expected_bytes(codec, tensors, world_size, allreduce_dtypes, nodes=None):
    """Bytes per step that the wire formats of ``hvd_compress.cost`` predict for ``tensors``
    (``Sent``) among ``world_size`` ranks; ``allreduce_dtypes``: the carriers the port's
    allreduce sums; ``nodes``: the ``topology.Nodes`` of two-level exchanges. A sparse
    codec's variable-length messages are counted at the sizes of the last step's
    selections."""
    total = 0
    for t in tensors:
        if t.route == cost.TWO_LEVEL:
            total += cost.two_level_traffic(
                codec, t.numel, nodes.local_size, nodes.cross_size, allreduce_dtypes, t.itemsize
            ).handed
        elif t.route in (UNCOMPRESSED, HALF):
            itemsize = 2 if t.route == HALF else t.itemsize
            total += cost.uncompressed_traffic(t.numel, world_size, itemsize).handed
        elif codec.message == "own_indices":
            total += cost.top_k_traffic(int(t.sent_elements), world_size).handed
        elif codec.message == "factors":
            total += cost.low_rank_traffic(int(t.sent_elements), world_size).handed
        elif codec.message == "bins":
            nbytes = codec.message_nbytes(
                t.numel, codec.bin_length(t.name, t.layer), int(t.sent_elements)
            )
            total += cost.allgather_with_sizes_traffic(nbytes, world_size).handed
        else:
            total += cost.compressed_traffic(
                codec, t.numel, world_size, t.route, allreduce_dtypes
            ).handed
    return total


def compression_stats(codec, step, bytes_handed, tensors):
    """``compression_stats()`` of both ports' wrappers: what the last step (the ``step``-th)
    handed to Horovod in all, against a plain allreduce of every gradient, and how each of
    ``tensors`` (``Sent``) travels, in all and by layer kind."""
    uncompressed = uncompressed_bytes(tensors)
    return {
        "codec": repr(codec),
        "step": step,
        "bytes_handed": bytes_handed,
        "bytes_uncompressed": uncompressed,
        "compression_ratio": uncompressed / bytes_handed if bytes_handed else float("nan"),
        "tensors": [(t.name, t.numel, t.route, t.reason) for t in tensors],
        "layers": layer_stats(tensors),
    }


def uncompressed_bytes(tensors):
    """Bytes per step that a plain allreduce of every gradient would hand over."""
    return sum(t.numel * t.itemsize for t in tensors)


def layer_stats(tensors):
    """Per layer kind, the last step's bytes handed to Horovod against a plain allreduce's,
    and the density: the fraction of the elements that this worker sent (quantized or
    whole)."""
    totals = collections.defaultdict(collections.Counter)
    for t in tensors:
        kind = totals[t.layer]
        kind["bytes_handed"] += t.bytes_handed
        kind["bytes_uncompressed"] += t.numel * t.itemsize
        kind["elements"] += t.numel
        kind["sent"] += t.numel if t.sent_elements is None else int(t.sent_elements)
    return {
        layer: {
            "bytes_handed": k["bytes_handed"],
            "bytes_uncompressed": k["bytes_uncompressed"],
            "compression_ratio": k["bytes_uncompressed"] / k["bytes_handed"]
            if k["bytes_handed"]
            else float("nan"),
            "density": k["sent"] / k["elements"] if k["elements"] else float("nan"),
        }
        for layer, k in totals.items()
    }
