"""One alltoall for the rows of several sharded exchanges (``hvd_compress.fusion``)."""

import horovod.torch as hvd
import torch

from hvd_compress.fusion import FusionGroup

from .exchange import wait


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

    def _alltoall(self, rows):
        self.handle = hvd.alltoall_async(torch.cat(rows, dim=1), name=self.name)
