"""One alltoall for the rows of several sharded exchanges (``hvd_compress.fusion``).

Mirrors ``hvd_compress.pt.fusion``."""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress.fusion import FusionGroup


class AlltoallFusion(FusionGroup):
    """A fusion group whose alltoall is a TensorFlow op of ``horovod.tensorflow``."""

    received = None

    def __init__(self, members, name, process_set=hvd.global_process_set):
        super().__init__(members, name)
        self.process_set = process_set  # the ranks of the alltoall

    def receive(self, member):
        """The rows that every rank sent ``member`` (row k from rank k)."""
        return self.received[:, self.columns[member]]

    def _alltoall(self, rows):
        payload = tf.concat(rows, axis=1)
        received = hvd.alltoall(
            payload, name=self.name, ignore_name_scope=True, process_set=self.process_set
        )
        # Equal splits: the same shape back, which Horovod's shape function leaves unknown.
        self.received = tf.reshape(received, payload.shape)
