"""The device a Horovod rank trains on, as the examples and a GPU job pick it. Mirrors
``hvd_compress.pt.device``."""

import horovod.tensorflow as hvd
import tensorflow as tf


def rank_device() -> str:
    """This rank's GPU, by its local rank, made the only GPU TensorFlow sees, where there
    are GPUs (one rank per GPU, as ``horovodrun`` and NCCL expect); else the CPU. Call it
    after ``hvd.init()`` and before TensorFlow initialises its devices."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "/CPU:0"
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    return "/GPU:0"
