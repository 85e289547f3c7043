"""The two-level exchange's part of a step (``exchange="two-level"``,
``hvd_compress.topology``): each node averages a gradient into shards, one per rank; the
ranks that hold the same shard on every node exchange it by the codec; each node gathers
its decoded shards back into the tensor.

``TwoLevelSteps`` is that part of ``CompressionPipeline`` (``tf/pipeline.py``), which
starts and finishes the exchanges.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import cost
from hvd_compress.cost import TF_ALLREDUCE_DTYPES, TWO_LEVEL
from hvd_compress.topology import averages_by_allreduce

from . import topology
from .exchange import collective_name


class TwoLevelSteps:
    """The two-level stages of a ``CompressionPipeline``'s exchanges (a mixin of it): the
    node's average, the exchange of this rank's shard among the nodes, the node's
    allgather."""

    def _join_nodes(self):
        """Takes the nodes where Horovod's ranks sit as the two-level exchange's layout:
        this rank's process sets (``topology.join``) and the exchange among the nodes of
        each tensor's shards. Collective."""
        self.nodes = topology.current_nodes()
        self.node_set, self.shard_set = topology.join(self.nodes)
        self.node_allreduce = averages_by_allreduce(not tf.config.list_logical_devices("GPU"))
        self.between_nodes = {
            plan.name: cost.two_level_inner(
                self.codec,
                self.nodes.shard_length(plan.numel),
                self.nodes.cross_size,
                TF_ALLREDUCE_DTYPES,
            )
            for plan in self.plans
            if plan.exchange == TWO_LEVEL and self.shard_set is not None
        }

    def _start_two_level(self, plan, grad, lr_ratio, alltoall_fusion):
        """The node's reduce-scatter (or allreduce, ``node_allreduce``) of ``grad``,
        zero-padded to the node's shards (``hvd_compress.topology``), then the start of the
        nodes' exchange of this rank's shard; returns what that exchange's ``finish``
        takes, or on a node alone the shard. On a node of one rank the shard is the
        gradient."""
        vector = tf.reshape(tf.cast(grad, tf.float32), [-1])
        if self.node_set is not None:
            length = self.nodes.shard_length(plan.numel)
            padded = tf.pad(vector, [[0, self.nodes.local_size * length - plan.numel]])
            average = hvd.allreduce if self.node_allreduce else hvd.reducescatter
            vector = average(
                self.meter.hand(padded),
                op=hvd.Average if self.average else hvd.Sum,
                name=f"{collective_name(plan)}.node",
                ignore_name_scope=True,
                process_set=self.node_set,
            )
            vector = self._own_shard(vector)
            vector.set_shape([length])
        if plan.name not in self.between_nodes:
            return vector
        return self._start(plan, vector, lr_ratio, alltoall_fusion)

    def _own_shard(self, average):
        """This rank's shard of its node's ``average``: a reduce-scatter's output, or its
        part of an allreduce's."""
        if not self.node_allreduce:
            return average
        _, shard = self.nodes.locate(self.rank)
        return tf.reshape(average, [self.nodes.local_size, -1])[shard]

    def _gather_shard(self, plan, shard):
        """The node's allgather of a two-level tensor's decoded ``shard``, cut to the
        tensor."""
        if self.node_set is not None:
            shard = hvd.allgather(
                self.meter.hand(shard),
                name=f"{collective_name(plan)}.gather",
                ignore_name_scope=True,
                process_set=self.node_set,
            )
        return shard[: plan.numel]
