"""The devices that tests run on: the CPU always, and CUDA where the machine has a GPU (one
per Horovod rank, by local rank). The same ``make test`` then runs the device-parametrised
tests on CUDA there, and reports them skipped, with the reason, on a machine without one."""
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))]


def rank_device(kind):
    """This Horovod rank's ``torch.device`` of ``kind`` (``"cpu"`` or ``"cuda"``: the GPU
    of the rank's local rank)."""
    if kind == "cuda":
        import horovod.torch as hvd
        return torch.device("cuda", hvd.local_rank())
    return torch.device(kind)
