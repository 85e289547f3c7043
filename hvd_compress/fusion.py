"""Sharded exchanges of a step that share one alltoall: which ones, and the group's
bookkeeping.

Horovod fuses the allreduces, and the allgathers, that are ready together into one collective
each, but runs every alltoall on its own, with a few round trips of latency however small it
is (~3 ms at 100 Mbit/s on the benchmark's host, ``cost.ALLTOALL_LATENCY_BYTES``). So the
sharded exchanges of a step hand their rows (one per destination rank) to a fusion group,
whose one alltoall carries every member's row k, side by side, to rank k: what Horovod's
fusion buffer does for allreduces. Each port starts and reads the group's alltoall
(``hvd_compress.pt.fusion``, ``hvd_compress.tf.fusion``).

Groups follow the order in which the backward pass produces gradients, the parameters'
order reversed, so that the first groups fill, and travel, while the backward pass goes on.
"""

from . import cost


def alltoall_groups(codec, tensors, world_size, threshold=None):
    """Names of the tensors of each group, in the order the groups fill.

    Args:
        codec: the codec the sharded exchanges carry.
        tensors: (name, numel) of every tensor whose exchange is ``sharded``, in the order
            of the parameters (the same on every rank: the groups must be too).
        threshold: bytes of a group's alltoall per worker at which it closes (default
            ``cost.FUSION_BYTES``; 0 gives every tensor an alltoall of its own).
    """
    threshold = cost.FUSION_BYTES if threshold is None else threshold
    groups, group, nbytes = [], [], 0
    for name, numel in reversed(tensors):
        group.append(name)
        nbytes += cost.alltoall_nbytes(codec, numel, world_size)
        if nbytes >= threshold:
            groups.append(group)
            group, nbytes = [], 0
    return groups + [group] if group else groups


class FusionGroup:
    """The bookkeeping of a fusion group, whatever the framework: collects each member's
    rows (a uint8 tensor of one row per rank), and once the last member's are in, has the
    port start one alltoall of them side by side (``_alltoall``) and notes which columns
    are whose (``columns``). The columns follow the order of ``members``, not the order in
    which the members arrive: that order follows the completion of their scales'
    allreduces, which can differ between ranks (with several NCCL streams), while every
    rank reads the columns it receives by its own slices.

    Args:
        members: names of the member tensors; every rank must give the same ones.
        name: the collective's name, by which Horovod matches the ranks' requests.
    """

    def __init__(self, members, name):
        self.name = name
        self.members = list(members)
        self.waiting = set(members)
        self.rows = {}
        self.columns = {}

    def send(self, member, rows):
        """Adds ``member``'s rows; the alltoall starts with the last member's."""
        self.rows[member] = rows
        self._arrive(member)
        return self

    def withdraw(self, member):
        """``member`` sends nothing this step (its gradient went another way on every rank)."""
        self._arrive(member)

    def _arrive(self, member):
        self.waiting.remove(member)
        if self.waiting or not self.rows:
            return
        start, joined = 0, []
        for member in self.members:
            rows = self.rows.get(member)
            if rows is not None:
                self.columns[member] = slice(start, start + rows.shape[1])
                start += rows.shape[1]
                joined.append(rows)
        self._alltoall(joined)
        self.rows.clear()  # the alltoall's payload holds the bytes now

    def _alltoall(self, rows):
        """Starts the alltoall of ``rows`` (the members' rows, in ``columns`` order) joined
        along their second axis."""
        raise NotImplementedError
