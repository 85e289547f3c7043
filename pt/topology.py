"""The Horovod process sets of the two-level exchange (``hvd_compress.topology``)."""

import atexit

import horovod.torch as hvd

from hvd_compress.topology import Nodes

from .exchange import allgather_object

# The process sets added for two-level exchanges, by their ranks: Horovod refuses a second
# set of the same ranks, and every pipeline of a job shares them.
_ADDED = {}


def current_nodes() -> Nodes:
    """Where the ranks of this job sit: each rank's node as ``hvd.cross_rank()`` numbers
    it (``horovodrun -H nodeA:4,nodeB:4`` and ``mpirun`` alike), gathered from every rank."""
    return Nodes.from_placement(
        allgather_object(hvd.cross_rank(), "hvdc.topology", hvd.global_process_set)
    )


def _process_set(ranks):
    """The process set of ``ranks``: the global one for every rank, else one added once."""
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    key = tuple(ranks)
    if key not in _ADDED:
        if not _ADDED:
            # Registered after Horovod's own exit handler, so that it runs before it.
            atexit.register(_barrier_at_exit)
        try:
            _ADDED[key] = hvd.add_process_set(list(ranks))
        except ValueError as error:  # not dynamic, or a set of these ranks exists
            raise RuntimeError(
                f"exchange='two-level' runs collectives among the ranks {list(ranks)}; "
                f"Horovod adds such process sets only when initialised with "
                f"hvd.init(process_sets='dynamic') ({error})"
            ) from error
    return _ADDED[key]


def _barrier_at_exit():
    """Waits at exit for every rank to reach its own. A rank whose last step is done may
    still be a member of the others' last collectives: its shard set's, finishing on the
    other node. Exiting shuts Horovod down for every rank, and would fail those."""
    try:
        hvd.barrier()
    except (RuntimeError, ValueError):  # Horovod already shut down: nothing in flight
        pass


def join(nodes: Nodes) -> tuple:
    """This rank's (node set, shard set): the process sets of its node's ranks and of the
    ranks that hold its shard on every node; None for a set of this rank alone. Collective:
    every rank adds every set, in one order, as Horovod requires."""
    node_sets = [_process_set(r) if len(r) > 1 else None for r in nodes.node_sets()]
    shard_sets = [_process_set(r) if len(r) > 1 else None for r in nodes.cross_sets()]
    node, shard = nodes.locate(hvd.rank())
    return node_sets[node], shard_sets[shard]
