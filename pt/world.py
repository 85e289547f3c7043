"""The ranks a ``CompressionPipeline`` exchanges among, agreeing with them, and what its state
becomes when elastic Horovod changes them or a checkpoint from another world is restored.

``ElasticWorld`` is the part of ``CompressionPipeline`` (``pt/pipeline.py``) that these
concern: its world size and rank, each compressed tensor's exchange for the world, and the
residuals that move when the world changes (the two-level exchange's nodes and process sets
are taken by ``TwoLevelSteps._join_nodes``, ``pt/two_level.py``).
"""

import horovod.torch as hvd
import torch

from hvd_compress import agreement, cost, watchdog
from hvd_compress.cost import TWO_LEVEL

from . import topology
from .exchange import (
    allgather_object,
    allreduce_async,
    make_exchange,
    meet,
    reducescatter_async,
    wait,
)


def max_over_ranks(values, name, process_set, dtype=torch.float64):
    """The element-wise largest of ``values`` (a list of numbers) over the ranks of
    ``process_set``, by one Max-allreduce of a CPU tensor, waited for: how the ranks agree
    on what each measured."""
    values = torch.tensor(values, dtype=dtype)
    return wait(allreduce_async(values, op=hvd.Max, name=name, process_set=process_set)).tolist()


class ElasticWorld:
    """The world of a ``CompressionPipeline`` (a mixin of it)."""

    def _choose_exchanges(self):
        """``exchange="auto"``: the compressed tensors' exchanges for this world, chosen
        together (``cost.choose_exchanges``: sharded tensors share alltoalls)."""
        if self.exchange != "auto":
            return
        compressed = [plan for plan in self.plans.values() if plan.reason == "compressed"]
        for plan, exchange in zip(
            compressed,
            cost.choose_exchanges(self.codec, [plan.numel for plan in compressed], self.world_size),
        ):
            plan.exchange = exchange

    def _agree(self):
        """Checks that every rank compresses alike (``hvd_compress.agreement``: a rank that
        differs would hang the others' collectives) and takes the largest step counter of
        any rank: before the first exchange, and again in a world that elastic Horovod
        changed. Not at construction: a worker that joins a running job constructs its
        pipeline where the others do not, and only meets them at a step.

        After rank 0 alone loaded a checkpoint and ``hvd.broadcast_optimizer_state`` shared
        the optimizer's state (which does not carry this pipeline's), or after a worker
        joined, the other ranks would count from 0; the counter chooses CLT-k's leader and
        the adaptive mode's decision steps, which every rank must take alike or hang.

        The same gather tells every rank where the others' watchdogs answer
        (``hvd_compress.watchdog``)."""
        gathered = allgather_object(
            (self._description, watchdog.address()), "hvdc.agreement", self.process_set
        )
        meet(self.process_set, [address for _, address in gathered], self.rank)
        problem = agreement.disagreement([description for description, _ in gathered])
        if problem:
            raise ValueError(problem)
        [self.state.step] = max_over_ranks(
            [self.state.step], "hvdc.step", self.process_set, torch.int64
        )
        self._agreed = True
        if self.state.planner is not None:
            self.state.planner.restart(self.state.step)
            self.follow_paths()

    def _follow_world(self):
        """Adapts to a world that elastic Horovod changed between steps (``hvd.elastic``).

        Residuals made in the old world of N ranks move into this rank's worker residual,
        rescaled so that the average over the new world of N' ranks carries the same mass:
        worker residuals times N'/N; the replicated server's residual as it is (every rank
        holds it); a sharded server's residual, which covers this rank's old shard only, times
        N' at that shard's positions. A rank that left takes its own residuals with it.
        ``exchange="auto"`` is decided again for N'. The two-level exchange takes the new
        layout (``_follow_nodes``), unless it kept its shape: then its servers are those of
        a flat exchange among one rank per node, or it compresses nothing (one node).
        """
        size, rank = self.process_set.size(), self.process_set.rank()
        if self.nodes is not None and topology.moved(self.nodes, self.node_set, self.shard_set):
            self._agreed = False
            self._follow_nodes(size, rank)
            return
        if (size, rank) == (self.world_size, self.rank):
            return
        if size != self.world_size:
            # Every rank sees the new size, so all agree again, with any that joined (a rank
            # renumbered in a world of the same size cannot tell whether others were).
            self._agreed = False
        if self.state.worker is not None:
            for name, residual in self.state.worker.residuals.items():
                self.state.worker.residuals[name] = residual * (size / self.world_size)
        if self.state.server is not None:
            self.buckets.release()
            for plan in self._server_plans().values():
                self._server_residual_to_worker(plan, size)
        self.world_size, self.rank = size, rank
        self._choose_exchanges()
        self.buckets.make(size, rank)
        if self.state.planner is not None:
            self.state.planner.restart(self.state.step)
            self.follow_paths()

    def _server_residual_to_worker(self, plan, world):
        """Moves the server residual of ``plan``'s tensor into this rank's worker residual,
        so that the next exchange among ``world`` ranks (for a two-level tensor: nodes),
        whose sum is divided by count (``world`` for an average, 1 for a sum), delivers it:
        the replicated server's (held by every rank) times count / world, a sharded
        server's (this rank's shard of the current world only) times count at that shard's
        positions; a restored residual by the exchange that kept it."""
        count = world if self.average else 1
        residual = self.state.server.residuals.pop(plan.name)
        exchange, numel, ranks, rank = self.server_exchange(plan)
        exchange = self._restored_servers.pop(plan.name, exchange)
        if exchange == "sharded":
            shard = make_exchange("sharded", self.codec, numel, ranks, self.meter, 1).shard(rank)
            full = residual.new_zeros(numel)
            full[shard] = residual * count
            residual = full
        else:
            residual = residual * (count / world)
        self.state.worker.residuals[plan.name] = self.state.worker.compensate(plan.name, residual)

    def _follow_restored_servers(self):
        """Moves each restored server residual that another exchange kept than the one its
        tensor takes now (a state saved with another ``exchange``, or whose world chose
        another) into the worker residual, as a change of world would
        (``_server_residual_to_worker``); the others stand."""
        plans = self._server_plans() if self._restored_servers else {}
        for name, exchange in list(self._restored_servers.items()):
            if name in plans and exchange != self.server_exchange(plans[name])[0]:
                self._server_residual_to_worker(plans[name], self.world_size)
        self._restored_servers = {}

    def _server_plans(self):
        """The plan of each tensor that has a server residual, by name."""
        by_name = {plan.name: plan for plan in self.plans.values()}
        return {name: by_name[name] for name in self.state.server.residuals}

    def server_exchange(self, plan):
        """(exchange, elements, ranks, this rank's index among them) of the exchange whose
        server keeps ``plan``'s server residual: the tensor's own among all ranks, or for a
        two-level tensor its shard's among the nodes (found from the layout, whose process
        sets an elastic reset may have dropped)."""
        if plan.exchange != TWO_LEVEL:
            return plan.exchange, plan.numel, self.world_size, self.rank
        _, shard = self.nodes.locate(self.rank)
        return (
            self.between_nodes[plan.name],
            self.nodes.shard_length(plan.numel),
            self.nodes.cross_size,
            self.nodes.cross_sets()[shard].index(self.rank),
        )

    def _follow_nodes(self, size, rank):
        """Takes the layout of a world that elastic Horovod changed, as ``_follow_world``
        does for a flat exchange. Collective.

        Each two-level tensor's residuals here are of this rank's shard of its node's
        average (server residuals moved into them, ``_server_residual_to_worker``), and
        reach the average over the old M nodes divided by M. Padded to the whole tensor and
        scaled by N' / M, the node averages of the new layout give each of its ranks a
        residual of its new shard that carries the same mass to the average over the N'
        ranks; on a layout of one node, which compresses nothing, the next step sends it
        (``_start_shard``).
        """
        scale = size / self.nodes.cross_size if self.average else 1.0
        _, shard = self.nodes.locate(self.rank)
        carried = {}
        for param, plan in self.plans.items():
            if plan.exchange != TWO_LEVEL or self.state.worker is None:
                continue
            if self.state.server is not None and plan.name in self.state.server.residuals:
                self._server_residual_to_worker(plan, self.nodes.cross_size)
            # Zeros where this rank holds no residual, in a dtype every rank agrees on.
            zeros = param.new_zeros(
                plan.numel, dtype=torch.promote_types(param.dtype, torch.float32)
            )
            padded = self._padded(plan, zeros)
            residual = self.state.worker.residuals.pop(plan.name, None)
            if residual is not None:
                padded.view(self.nodes.local_size, -1)[shard] = residual * scale
            carried[plan.name] = (plan, padded[: plan.numel])
        self.world_size, self.rank = size, rank
        self._join_nodes()
        for name, (plan, spread) in carried.items():
            residual = self._padded(plan, spread)
            if self.node_set is not None:
                residual = wait(
                    reducescatter_async(
                        residual,
                        name=f"hvdc.{name}.relayout",
                        op=hvd.Average if self.average else hvd.Sum,
                        process_set=self.node_set,
                    )
                )
            self.state.worker.residuals[name] = residual

    def state_dict(self):
        # The world the residuals were made in: a state restored into another world is
        # adapted to it at the next step (``_follow_world``).
        state = {**self.state.state_dict(), "world_size": self.world_size, "rank": self.rank}
        state = self.buckets.split_state(state)
        if self.state.server is not None:  # whose servers kept the server residuals
            plans = {plan.name: plan for plan in self.plans.values()}
            state["server_exchanges"] = {
                name: self.server_exchange(plans[name])[0] for name in state["server"]
            }
        if self.nodes is not None:  # the residuals are of this layout's shards
            state["nodes"] = self.nodes.node_sets()
        return state

    def load_state_dict(self, state):
        nodes = None if self.nodes is None else self.nodes.node_sets()
        if state.get("nodes", nodes) != nodes:
            raise ValueError(
                f"load_state_dict: the state's residuals are of a two-level exchange's "
                f"shards on the nodes {state.get('nodes')}; this pipeline's nodes are {nodes}"
            )
        self.world_size = int(state.get("world_size", self.world_size))
        self.rank = int(state.get("rank", self.rank))
        self.state.load_state_dict(state, self.placed)
        if self.state.server is not None:
            self._restored_servers = dict(
                state.get("server_exchanges") or self._implied_server_exchanges()
            )
        if self.state.planner is not None:
            self.follow_paths()

    def _implied_server_exchanges(self):
        """The exchange that kept each server residual of a state that does not name it,
        by its length: the whole tensor (or two-level shard) on every rank is an allgather's
        replicated server, a part of it a sharded server's shard."""
        residuals = self.state.server.residuals
        return {
            name: (
                "allgather"
                if residuals[name].numel() == self.server_exchange(plan)[1]
                else "sharded"
            )
            for name, plan in self._server_plans().items()
        }

    def placed(self, tensors):
        """Copies of ``tensors`` (parameter name -> state tensor) on their parameters'
        devices: a checkpoint is usually loaded with ``map_location="cpu"``, and its state
        must live where the gradients are, apart from the dict it was loaded into."""
        devices = {plan.name: param.device for param, plan in self.plans.items()}
        devices.update({b.name: devices[b.members[0].plan.name] for b in self.buckets})
        return {
            name: tensor.to(devices.get(name, tensor.device), copy=True)
            for name, tensor in tensors.items()
        }
