"""The devices that tests run on: the CPU always, and CUDA where the machine has a GPU (one
per Horovod rank, by local rank). The same ``make test`` then runs the device-parametrised
tests on CUDA there, and reports them skipped, with the reason, on a machine without one."""

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device on this machine"
        ),
    ),
]


def rank_device(kind):
    """This Horovod rank's ``torch.device`` of ``kind``: ``"cpu"``, or ``"cuda"`` for the
    rank's own GPU as a job picks it (``hvd_compress.pt.device.rank_device``)."""
    if kind == "cuda":
        from hvd_compress.pt.device import rank_device as gpu_of_this_rank

        return gpu_of_this_rank()
    return torch.device(kind)
