"""The Horovod process sets of the two-level exchange (``hvd_compress.topology``)."""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import topology
from hvd_compress.topology import Nodes

from .exchange import watched


def current_nodes() -> Nodes:
    """Where the ranks of this job sit: each rank's node as ``hvd.cross_rank()`` numbers
    it (``horovodrun -H nodeA:4,nodeB:4`` and ``mpirun`` alike), gathered from every rank
    (eagerly, also while a ``tf.function`` traces)."""
    with tf.init_scope(), watched("allgather_object", "hvdc.topology", hvd.global_process_set):
        placement = hvd.allgather_object(
            hvd.cross_rank(), name="hvdc.topology", process_set=hvd.global_process_set
        )
    return Nodes.from_placement(placement)


def join(nodes: Nodes) -> tuple:
    """This rank's (node set, shard set) (``hvd_compress.topology.join``)."""
    with tf.init_scope():
        return topology.join(hvd, nodes, _barrier)


def _barrier():
    """A barrier of all ranks: horovod.tensorflow has no ``barrier``, an allreduce is one."""
    with watched("allreduce", "hvdc.barrier", hvd.global_process_set):
        hvd.allreduce(tf.zeros([]), name="hvdc.barrier", process_set=hvd.global_process_set)
