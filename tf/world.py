"""The ranks a ``CompressionPipeline`` exchanges among, agreeing with them, and what its state
becomes when elastic Horovod changes them.

``ElasticWorld`` is the part of ``CompressionPipeline`` (``tf/pipeline.py``) that these
concern, as ``pt/world.py`` is the PyTorch pipeline's: its world size and rank, each
compressed tensor's exchange for the world, and the residuals that move when the world
changes. A traced step fixes the world it was traced in: after a change the step must be
traced again (``hvd_compress.tf.elastic.KerasState`` makes Keras retrace ``fit``'s).
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import agreement, cost, watchdog
from hvd_compress.cost import TF_ALLREDUCE_DTYPES

from .exchange import meet, watched


class ElasticWorld:
    """The world of a ``CompressionPipeline`` (a mixin of it)."""

    def _choose_exchanges(self):
        """``exchange="auto"``: the compressed tensors' exchanges for this world, chosen
        together (``cost.choose_exchanges``: sharded tensors share alltoalls)."""
        if self.exchange != "auto":
            return
        compressed = [plan for plan in self.plans if plan.reason == "compressed"]
        for plan, exchange in zip(
            compressed,
            cost.choose_exchanges(
                self.codec,
                [plan.numel for plan in compressed],
                self.world_size,
                TF_ALLREDUCE_DTYPES,
            ),
        ):
            plan.exchange = exchange

    def _agree(self):
        """Checks that every rank compresses alike (``hvd_compress.agreement``: a rank that
        differs would hang the others' collectives) and takes the largest step counter of
        any rank: before the first exchange, and again in a world that elastic Horovod
        changed. Not at construction: a worker that joins a running job builds its
        optimizer where the others do not, and only meets them at a step. Eager, also while
        a step is traced; the same gather tells every rank where the others' watchdogs
        answer (``hvd_compress.watchdog``).

        The counter positions the random streams and chooses CLT-k's leader, which every
        rank must take alike: after rank 0 alone restored a checkpoint, or a worker
        joined, the others would count from another step."""
        with tf.init_scope(), watched("allgather", "hvdc.agreement", self.process_set):
            gathered = hvd.allgather_object(
                (self._description, watchdog.address(), int(self.state.step.numpy())),
                name="hvdc.agreement",
                process_set=self.process_set,
            )
            meet(self.process_set, [address for _, address, _ in gathered], self.rank)
            problem = agreement.disagreement([description for description, _, _ in gathered])
            if problem:
                raise ValueError(problem)
            self.state.step.assign(max(step for _, _, step in gathered))
            if self.state.planner is not None:
                self.state.planner.restart(int(self.state.step.numpy()))
                self.follow_paths()
        self._agreed = True

    def check_traced_world(self):
        """In a traced step, an op that raises when the step runs in another world than
        the one it was traced in (its exchanges, shards and reshapes are that world's):
        after an elastic change the step must be traced again."""
        if tf.executing_eagerly():
            return
        tf.debugging.assert_equal(
            hvd.size_op(self.process_set.process_set_id),
            self.world_size,
            message=(
                f"hvd_compress: this step was traced for {self.world_size} ranks and runs in "
                f"another world; after an elastic change trace it again (define the "
                f"tf.function inside the function that hvd.elastic.run wraps)"
            ),
        )

    def follow_world(self) -> None:
        """Takes the world that elastic Horovod made at a reset: adapts to its size and
        rank (``_follow_world``) and agrees with its ranks again at the next step, also
        where the size stayed (a worker that replaced another, which the staying ones
        cannot tell from the size)."""
        self._follow_world()
        self._agreed = False

    def _follow_world(self):
        """Adapts to a world that elastic Horovod changed since the last step, as the
        PyTorch port's ``ElasticWorld._follow_world``: residuals made among N ranks move
        into this rank's worker residual, rescaled so that the average over the new N'
        carries the same mass (worker residuals times N'/N; the replicated server's
        residual as it is; a sharded server's shard times N' at its positions), and the
        exchanges are made again for N', ``exchange="auto"`` chosen anew. A rank that left
        takes its residuals with it. Eager, also while a step is traced."""
        size, rank = self.process_set.size(), self.process_set.rank()
        if (size, rank) == (self.world_size, self.rank):
            return
        if self.nodes is not None:
            raise ValueError(
                f"CompressionPipeline: the world changed from {self.world_size} to {size} "
                f"ranks; a two-level exchange keeps its nodes' process sets for the world it "
                f"was built in (elastic training takes the flat exchanges)"
            )
        self._agreed = False
        with tf.init_scope():
            worker, server = self.state.worker, self.state.server
            if worker is not None:
                for residual in worker.residuals.values():
                    residual.assign(residual * (size / self.world_size))
            if server is not None:
                for name, residual in server.residuals.items():
                    worker.residuals[name].assign_add(self._server_mass(name, residual, size))
            self.world_size, self.rank = size, rank
            self._choose_exchanges()
            self._make_exchanges()

    def _server_mass(self, name, residual, world):
        """The server ``residual`` of tensor ``name``, made in this world, as a worker
        residual that the next exchange among ``world`` ranks, whose sum is divided by count
        (``world`` for an average, 1 for a sum), delivers: the replicated server's (held by
        every rank) times count / world, a sharded server's (this rank's shard only) times
        count at that shard's positions."""
        count = world if self.average else 1
        exchange = self.exchanges[name]
        if exchange.name != "sharded":
            return residual * (count / world)
        # A last shard may lie past the tensor's end, holding none of it.
        start = min(exchange.shard(self.rank).start, exchange.numel)
        return tf.pad(residual * count, [[start, exchange.numel - start - residual.shape[0]]])
