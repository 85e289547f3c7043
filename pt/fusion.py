"""One alltoall for the rows of several sharded exchanges (``hvd_compress.fusion``)."""

import horovod.torch as hvd
import torch

from hvd_compress.fusion import FusionGroup

from .exchange import alltoall_async, wait


class AlltoallFusion(FusionGroup):
    """A fusion group whose alltoall is one of ``horovod.torch``'s asynchronous handles."""

    handle = None
    received = None

    def receive(self, member):
        """The rows that every rank sent ``member`` (row k from rank k). Waits for the
        alltoall once, for all members."""
        if self.received is None:
            self.received, _ = wait(self.handle)
        return self.received[:, self.columns[member]]

    def __init__(self, members, name, process_set=hvd.global_process_set):
        super().__init__(members, name)
        self.process_set = process_set  # the ranks of the alltoall

    def _alltoall(self, rows):
        rows = torch.cat(rows, dim=1)
        self.handle = alltoall_async(rows, name=self.name, process_set=self.process_set)
