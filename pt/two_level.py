"""The two-level exchange's part of a step (``exchange="two-level"``,
``hvd_compress.topology``): each node averages a gradient into shards, one per rank; the
ranks that hold the same shard on every node exchange it by the codec; each node gathers
its decoded shards back into the tensor.

``TwoLevelSteps`` is that part of ``CompressionPipeline`` (``pt/pipeline.py``), which
launches and collects the flights; what the layout becomes when elastic Horovod changes the
world is ``ElasticWorld._follow_nodes``'s (``pt/world.py``).
"""

import functools

import horovod.torch as hvd

from hvd_compress import cost
from hvd_compress.cost import TWO_LEVEL
from hvd_compress.topology import averages_by_allreduce

from . import topology
from .exchange import allgather_async, allreduce_async, reducescatter_async, wait
from .flight import Flight


class TwoLevelSteps:
    """The two-level stages of a ``CompressionPipeline``'s flights (a mixin of it):
    "shard" (the node's average), then "scale" and "codes" among the nodes, then "gather"
    (the node's allgather)."""

    def _join_nodes(self):
        """Takes the nodes where Horovod's ranks sit as the two-level exchange's layout:
        this rank's process sets (``topology.join``) and the exchange among the nodes of
        each tensor's shards. Collective."""
        self.nodes = topology.current_nodes()
        self.node_set, self.shard_set = topology.join(self.nodes)
        self.node_allreduce = averages_by_allreduce(all(p.device.type == "cpu" for p in self.plans))
        self.between_nodes = {
            plan.name: cost.two_level_inner(
                self.codec, self.nodes.shard_length(plan.numel), self.nodes.cross_size
            )
            for plan in self.plans.values()
            if plan.exchange == TWO_LEVEL and self.shard_set is not None
        }

    def _launch_two_level(self, plan, param, grad, lr_ratio):
        """Starts the node's reduce-scatter (or allreduce, ``node_allreduce``) of ``grad``,
        zero-padded to the node's shards; on a node of one rank the shard is the
        gradient."""
        flight = Flight(plan, param, "shard", lr_ratio=lr_ratio)
        vector = grad.reshape(-1)
        if self.node_set is None:
            flight.vector = vector
            self._start_shard(flight)
            return flight
        average = allreduce_async if self.node_allreduce else reducescatter_async
        flight.handle = average(
            self.meter.hand(self._padded(plan, vector)),
            name=f"hvdc.{plan.name}.node",
            op=hvd.Average if self.average else hvd.Sum,
            process_set=self.node_set,
        )
        return flight

    def _padded(self, plan, vector):
        """The flat ``vector`` of ``plan``'s tensor zero-padded to its node's L shards of
        equal length (``hvd_compress.topology.Nodes.shard_length``)."""
        length = self.nodes.local_size * self.nodes.shard_length(plan.numel)
        if length == plan.numel:
            return vector
        padded = vector.new_zeros(length)
        padded[: plan.numel] = vector
        return padded

    def _own_shard(self, average):
        """This rank's shard of its node's ``average``: a reduce-scatter's output, or its
        part of an allreduce's."""
        if not self.node_allreduce:
            return average
        _, shard = self.nodes.locate(self.rank)
        return average.view(self.nodes.local_size, -1)[shard]

    def _start_shard(self, flight):
        """The exchange among the nodes of a two-level flight's shard (``flight.vector``):
        by the codec where there are other nodes, else straight to the node's allgather,
        carrying any residual that a layout with other nodes left (``_follow_nodes``)."""
        if self.shard_set is None:
            shard, name = flight.vector, flight.plan.name
            if self.state.worker is not None and name in self.state.worker.residuals:
                shard = self.state.worker.flush(name, shard, flight.lr_ratio)
            self._gather_shard(flight, shard)
            return
        exchange = self.between_nodes[flight.plan.name]
        flight.fused = self._compensates_in_kernels(flight.vector)
        self._start_scale(flight, None, exchange, self.nodes.cross_size, self.shard_set)

    def _gather_shard(self, flight, shard):
        """Starts the node's allgather of a two-level flight's decoded ``shard``."""
        flight.stage = "gather"
        if self.node_set is None:
            flight.result = lambda: shard
            return
        handle = allgather_async(
            self.meter.hand(shard.contiguous()),
            name=f"hvdc.{flight.plan.name}.gather",
            process_set=self.node_set,
        )
        flight.result = functools.partial(wait, handle)
