"""Which ranks share a node: the layout of the two-level exchange.

A GPU cluster's nodes hold L ranks each, joined by fast links inside (NVLink, PCIe, shared
memory) and a slower network between the M nodes. The two-level exchange sums inside each
node first, uncompressed, and compresses only what crosses the network: rank l of every
node exchanges the codes of shard l of its node's average with rank l of the other nodes.
Its collectives run in two families of Horovod process sets: each node's L ranks, and each
local rank's M ranks across the nodes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Global ranks grouped by node.

    Horovod orders a process set's ranks by global rank, and a reduce-scatter gives the
    set's k-th rank the k-th part: so rank ``ranks[m][k]``, the k-th smallest of node m's,
    holds shard k of node m's sum, and exchanges it with the k-th rank of every other node.

    Args:
        ranks: each node's global ranks, ascending; nodes ordered by their smallest rank.
            Every node holds the same number of ranks, as Horovod's hierarchical
            collectives require.
    """

    ranks: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        sizes = {len(node) for node in self.ranks}
        if not self.ranks or len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                f"Nodes: every node must hold the same number of ranks (at least one); "
                f"got ranks per node {[len(node) for node in self.ranks]}"
            )
        flat = [rank for node in self.ranks for rank in node]
        if sorted(flat) != list(range(len(flat))):
            raise ValueError(f"Nodes: the ranks must be 0..N-1, each once; got {self.ranks}")
        if any(list(node) != sorted(node) for node in self.ranks) or [
            node[0] for node in self.ranks
        ] != sorted(node[0] for node in self.ranks):
            raise ValueError(
                f"Nodes: each node's ranks ascending, nodes by their smallest; got {self.ranks}"
            )

    @classmethod
    def from_placement(cls, nodes: Sequence[int]) -> Nodes:
        """The layout of ranks whose nodes are ``nodes``, in global rank order (each
        rank's ``hvd.cross_rank()``, which numbers the nodes)."""
        grouped: dict[int, list[int]] = {}
        for rank, node in enumerate(nodes):
            grouped.setdefault(node, []).append(rank)
        return cls(tuple(sorted(tuple(ranks) for ranks in grouped.values())))

    @property
    def local_size(self) -> int:
        """L: ranks per node."""
        return len(self.ranks[0])

    @property
    def cross_size(self) -> int:
        """M: nodes."""
        return len(self.ranks)

    def node_sets(self) -> list[list[int]]:
        """Each node's ranks: the uncompressed collectives'."""
        return [list(node) for node in self.ranks]

    def cross_sets(self) -> list[list[int]]:
        """For each shard k, the ranks that hold it (the k-th of every node), ascending:
        the compressed exchange's."""
        return [sorted(node[k] for node in self.ranks) for k in range(self.local_size)]

    def locate(self, rank: int) -> tuple[int, int]:
        """(node, shard) of global ``rank``: its node's index, and the shard it holds (its
        position among the node's ranks)."""
        for node, ranks in enumerate(self.ranks):
            if rank in ranks:
                return node, ranks.index(rank)
        raise ValueError(f"Nodes: rank {rank} is on no node of {self.ranks}")

    def shard_length(self, numel: int) -> int:
        """Elements of each shard of a tensor of ``numel`` elements: the tensor is padded
        with zeros to L shards of equal length."""
        return -(-numel // self.local_size)


def averages_by_allreduce(on_cpu: bool) -> bool:
    """Whether a node averages its two-level tensors by an allreduce of the whole tensor, of
    which each rank keeps its shard, rather than by a reduce-scatter: for tensors on the CPU
    (``on_cpu``). Horovod's CPU reduce-scatters (Gloo's halving-doubling, each round one
    message of all that remains; MPI's) finish after its allreduces of twice the bytes
    (``benchmarks/node_average.py``); NCCL's is the first half of its ring allreduce."""
    return on_cpu


# The process sets added for two-level exchanges, by their ranks: Horovod refuses a second
# set of the same ranks, and every pipeline of a job shares them.
_ADDED = {}


def _process_set(hvd, ranks, barrier):
    """The process set of ``ranks`` (``hvd``: ``horovod.torch`` or ``horovod.tensorflow``):
    the global one for every rank, else one added once."""
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    key = tuple(ranks)
    if key not in _ADDED:
        if not _ADDED:
            # Registered after the exit handler of Horovod's latest hvd.init(), so that it
            # runs before it.
            atexit.register(_barrier_at_exit, barrier)
        try:
            _ADDED[key] = hvd.add_process_set(list(ranks))
        except ValueError as error:  # not dynamic, or a set of these ranks exists
            raise RuntimeError(
                f"exchange='two-level' runs collectives among the ranks {list(ranks)}; "
                f"Horovod adds such process sets only when initialised with "
                f"hvd.init(process_sets='dynamic') ({error})"
            ) from error
    return _ADDED[key]


def _registered(hvd, process_set) -> bool:
    """Whether Horovod still knows ``process_set`` (None: a set of one rank, which it
    never needed to): an elastic reset re-initialises Horovod, which then knows the
    global set alone."""
    if process_set is None or process_set is hvd.global_process_set:
        return True
    try:
        return process_set.size() == len(process_set.ranks)
    except ValueError:  # "Process set does not exist or has not been registered."
        return False


def moved(hvd, nodes: Nodes, process_sets: Sequence) -> bool:
    """Whether the ranks left the layout ``nodes``, as far as every rank sees it alike:
    Horovod's world has another shape (ranks, ranks per node, nodes), or Horovod has
    forgotten this rank's ``process_sets`` (re-initialised, it forgets every added set on
    every rank). Every rank answers the same, so all can take the new layout together.
    A layout of the same shape whose sets are only the global one (one node, or one rank
    per node) gives each rank the same part in its node again, whatever its number."""
    shape = (hvd.size(), hvd.local_size(), hvd.cross_size())
    if shape != (nodes.local_size * nodes.cross_size, nodes.local_size, nodes.cross_size):
        return True
    return any(not _registered(hvd, process_set) for process_set in process_sets)


def _barrier_at_exit(barrier):
    """Waits at exit for every rank to reach its own ``barrier``. A rank whose last step is
    done may still be a member of the others' last collectives: its shard set's, finishing
    on the other node. Exiting shuts Horovod down for every rank, and would fail those."""
    # Horovod already shut down, whichever error its framework raises: nothing in flight.
    with contextlib.suppress(Exception):
        barrier()


def join(hvd, nodes: Nodes, barrier: Callable[[], None]) -> tuple:
    """This rank's (node set, shard set) of ``hvd``'s Horovod: the process sets of its
    node's ranks and of the ranks that hold its shard on every node; None for a set of
    this rank alone. Collective: every rank adds every set, in one order, as Horovod
    requires. ``barrier``: a barrier of all ranks, which each rank passes at exit."""
    for key in [key for key, added in _ADDED.items() if not _registered(hvd, added)]:
        del _ADDED[key]  # added before Horovod was last initialised
    node_sets = [_process_set(hvd, r, barrier) if len(r) > 1 else None for r in nodes.node_sets()]
    shard_sets = [_process_set(hvd, r, barrier) if len(r) > 1 else None for r in nodes.cross_sets()]
    node, shard = nodes.locate(hvd.rank())
    return node_sets[node], shard_sets[shard]
