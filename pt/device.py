"""The device a Horovod rank trains on, as the examples and a GPU job pick it."""

import horovod.torch as hvd
import torch


def rank_device() -> torch.device:
    """This rank's GPU, by its local rank, made the current CUDA device, where CUDA is
    available (one rank per GPU, as ``horovodrun`` and NCCL expect); else the CPU. Call it
    after ``hvd.init()``."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(hvd.local_rank())
    return torch.device("cuda", hvd.local_rank())
