"""Horovod process sets in test bodies: every rank of a 4-rank job registers the same sets
when it initialises Horovod, and a body trains inside one of them.

A layout is a tuple of sets (tuples of global ranks): ``PAIRS`` splits four ranks into two
data-parallel groups, ``THREE`` leaves rank 3 outside its one group.
"""

SETS = ((0, 1), (2, 3), (0, 1, 2))
# No sets at initialisation: the body adds its own (``hvd.add_process_set``).
DYNAMIC = "dynamic"
PAIRS = ((0, 1), (2, 3))
THREE = ((0, 1, 2),)

_registered = {}


def join(hvd, layout=None):
    """Initialises Horovod (``hvd``: ``horovod.torch`` or ``horovod.tensorflow``) and returns
    this rank's process set of ``layout``: the set that holds it, else the layout's first
    set, which it is outside of; the global set for ``layout=None``."""
    if layout is None or layout == DYNAMIC:
        hvd.init(**({"process_sets": DYNAMIC} if layout == DYNAMIC else {}))
        return hvd.global_process_set
    if not _registered:
        sets = {ranks: hvd.ProcessSet(list(ranks)) for ranks in SETS}
        hvd.init(process_sets=list(sets.values()))
        _registered.update(sets)
    return _registered[next((s for s in layout if hvd.rank() in s), layout[0])]


def members(results, ranks):
    """The results of the ranks of one set, in their order in the set (their set ranks)."""
    return [results[rank] for rank in ranks]
