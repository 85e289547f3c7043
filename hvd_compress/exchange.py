"""What one tensor's exchange is apart from its framework: the tensor, the ranks, the server
and the fusion it uses, and how its messages are laid out (scale heads, shard lengths,
which rank serves which shard). The ports' exchanges (``hvd_compress.pt.exchange``,
``hvd_compress.tf.exchange``) subclass these with their collectives and tensor operations;
the cost model (``hvd_compress.cost``) counts the bytes of the same layouts."""

from __future__ import annotations

from .codes import shard_length


class Meter:
    """Counts the bytes of every tensor handed to a Horovod collective (the port's ``hand``),
    in all and per gradient tensor: the one named by ``charging``."""

    def __init__(self):
        self.tensor = None

    def charging(self, name):
        """Counts the bytes handed inside this ``with`` block for the gradient tensor
        ``name``. The meter is its own context manager: entered for every tensor several
        times a step, where a generator-based one costs microseconds each time."""
        self.tensor = name
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tensor = None


class Exchange:
    """One tensor's exchange among ``world_size`` ranks.

    Args:
        codec: the tensor's codec.
        numel: the tensor's elements.
        world_size: the ranks that exchange it, ranked within ``process_set``.
        meter: what counts the bytes handed to the collectives (the port's ``Meter``).
        count: the workers the sum is averaged over (``world_size``; 1 for a sum).
        server: the server compression of a two-way codec (``hvd_compress.server``), or None.
        fusion: the ``AlltoallFusion`` that carries a sharded exchange's alltoall, or None.
        process_set: the Horovod process set of the ranks.
    """

    # Whether the last result of ``finish`` is all finite, where the exchange knows it
    # without reading the result; None where it does not.
    finite = None
    # The indices of the velocity this worker sent, which its momentum forgets (DGC's
    # momentum factor masking); None for exchanges that send no part of it.
    selected = None

    def __init__(
        self, codec, numel, world_size, meter, count, server=None, fusion=None, *, process_set
    ):
        self.codec, self.numel, self.world_size = codec, numel, world_size
        self.meter, self.count, self.server = meter, count, server
        self.process_set = process_set
        self.fusion = fusion
        # Elements this worker sends (a tensor, for sparse codecs: known once it selected).
        self.sent_elements = numel

    def server_numel(self, rank: int) -> int:
        """Elements of the server residual that ``rank`` keeps for this tensor."""
        return self.numel


class Allgather(Exchange):
    """Every worker's packed codes reach every worker, headed by its own scales where the
    codec's scales are not shared (4 bytes each); Elias-coded codes (``wire="elias"``) vary
    in length, so their lengths travel too."""

    name = "allgather"

    def __init__(self, codec, numel, world_size, meter, count, server=None, fusion=None, **options):
        super().__init__(codec, numel, world_size, meter, count, server, fusion, **options)
        self.own_scale = codec.scaled and not codec.shares_scale(self.name)
        self.scale_bytes = 4 * codec.buckets(numel) if self.own_scale else 0
        self.elias = codec.wire == "elias"


class Sharded(Exchange):
    """Reduce-scatter by alltoall, then an allgather of the summed shards: the tensor is cut
    into ``world_size`` shards of ``length`` codes that start on byte boundaries both in the
    codes' space and in that of their sums over the ranks (``total_space``)."""

    name = "sharded"

    def __init__(self, codec, numel, world_size, meter, count, server=None, fusion=None, **options):
        super().__init__(codec, numel, world_size, meter, count, server, fusion, **options)
        self.total_space = codec.value_space.summed(world_size)
        self.length = shard_length(numel, world_size, codec.code_space, self.total_space)


class ShardedServer(Exchange):
    """The sharded exchange of a two-way codec (the shape of DeepSpeed's compressed
    allreduce): rank k is the server of the k-th shard of ``length`` codes.

    An alltoall sends rank k every worker's sign bits of shard k, each headed by that
    worker's block scales of the whole tensor (``scale_bytes``); rank k decodes and averages
    them, adds its server residual for the shard and compresses the result again, with
    blocks cut at the shard's edges (so server blocks differ from the replicated server's);
    an allgather returns every server's message, headed by its block scales of its shard
    (``server_scale_bytes``). The last shards may hold fewer of the tensor's elements than
    ``length``, or none (``valid``). Bytes per worker stay nearly flat as the world grows.
    """

    name = "sharded"

    def __init__(self, codec, numel, world_size, meter, count, server=None, fusion=None, **options):
        super().__init__(codec, numel, world_size, meter, count, server, fusion, **options)
        self.length = shard_length(numel, world_size, codec.code_space)
        self.scale_bytes = 4 * codec.buckets(numel)
        self.server_scale_bytes = 4 * codec.buckets(self.length)

    @property
    def shard_bytes(self) -> int:
        """Bytes of a shard's packed codes (shards start on byte boundaries)."""
        return self.length // self.codec.code_space.codes_per_byte

    def valid(self, rank: int) -> int:
        """Elements of shard ``rank`` inside the tensor."""
        return max(0, min(self.length, self.numel - rank * self.length))

    def shard(self, rank: int) -> slice:
        """The elements of the tensor whose server is ``rank``."""
        return slice(rank * self.length, rank * self.length + self.valid(rank))

    def server_numel(self, rank: int) -> int:
        return self.valid(rank)


class SparseExchange(Exchange):
    """The exchange of a sparse codec, whose state lives in its memory; ``message`` is the
    ``Codec.message`` it carries.

    Args (after those of every exchange):
        memory: the worker's ``ErrorFeedback``.
        plan: the tensor's ``TensorPlan`` (its name keys the memory).
        step: the step counter: a Python int in PyTorch, the pipeline's variable in a
            TensorFlow graph.
    """

    def __init__(self, codec, numel, world_size, meter, count, memory, plan, step, **options):
        super().__init__(codec, numel, world_size, meter, count, **options)
        self.memory, self.key, self.step = memory, plan.name, step


class SparseAllgather(SparseExchange):
    """AdaComp: every worker's variable-length message, and its length, reach every worker,
    which decodes them all and sums them in rank order. The memory holds the residues; the
    plan's layer kind chooses the bin length. Every step is alike."""

    name = "allgather"
    message = "bins"

    def __init__(self, codec, numel, world_size, meter, count, memory, plan, step, **options):
        super().__init__(codec, numel, world_size, meter, count, memory, plan, step, **options)
        self.bin_length = codec.bin_length(plan.name, plan.layer)


class LeaderAllreduce(SparseExchange):
    """CLT-k: the leader of this step (chosen by the step counter) broadcasts its top-k
    indices, and one allreduce sums every worker's values at them. The memory, low-pass
    filtered by the codec's beta, is updated between the two collectives: its update needs
    the leader's indices."""

    name = "allreduce"
    message = "shared_indices"


class TopKAllgather(SparseExchange):
    """DGC: every worker's top-k of its accumulated velocity (the memory holds the
    accumulation v), as k int32 indices and k float32 values on two allgathers (k, which the
    step counter sets during the warm-up, is the same on every worker), decoded into a sum
    in rank order."""

    name = "allgather"
    message = "own_indices"


class LowRankAllreduce(SparseExchange):
    """PowerSGD: P = M Q summed by one allreduce and orthogonalized, then Q = M^T P summed
    by a second; the average is P Q^T. M is the error-compensated gradient as a matrix (of
    the plan's shape), Q the factor of the last step. The memory's update needs the summed
    factors, so it happens once both have arrived. Every compressed step is alike.

    Args (after those of every sparse exchange):
        factors: the ``FactorMemory`` holding each tensor's Q.
    """

    name = "allreduce"
    message = "factors"

    def __init__(
        self, codec, numel, world_size, meter, count, memory, plan, step, factors, **options
    ):
        super().__init__(codec, numel, world_size, meter, count, memory, plan, step, **options)
        self.factors = factors
        self.matrix_shape = codec.matrix_shape(plan.shape)
        self.sent_elements = codec.factor_elements(plan.shape)

    def delivered(self, average):
        """What the exchange returns of the ``average`` it computed: the average, or the
        sum where it sums (``count`` 1, as Horovod's op=Sum)."""
        return average if self.count == self.world_size else average * self.world_size
