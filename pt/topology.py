"""The Horovod process sets of the two-level exchange (``hvd_compress.topology``)."""

import horovod.torch as hvd

from hvd_compress import topology
from hvd_compress.topology import Nodes

from .exchange import allgather_object


def current_nodes() -> Nodes:
    """Where the ranks of this job sit: each rank's node as ``hvd.cross_rank()`` numbers
    it (``horovodrun -H nodeA:4,nodeB:4`` and ``mpirun`` alike), gathered from every rank."""
    return Nodes.from_placement(
        allgather_object(hvd.cross_rank(), "hvdc.topology", hvd.global_process_set)
    )


def join(nodes: Nodes) -> tuple:
    """This rank's (node set, shard set) (``hvd_compress.topology.join``)."""
    return topology.join(hvd, nodes, hvd.barrier)


def moved(nodes: Nodes, node_set, shard_set) -> bool:
    """Whether the ranks left the layout ``nodes`` and this rank's process sets
    (``hvd_compress.topology.moved``)."""
    return topology.moved(hvd, nodes, (node_set, shard_set))
