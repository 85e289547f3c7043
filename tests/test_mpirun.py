"""A job started by OpenMPI's mpirun that hands Horovod an mpi4py communicator."""

import pytest
import torch

import hvd_compress

from .harness import run_parallel
from .pt_jobs import TERNGRAD, check_consistent_and_exact, train

pytestmark = pytest.mark.multiprocess


def _train_on_mpi4py_comm():
    import horovod.torch as hvd
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD)
    assert hvd.mpi_enabled() and hvd.size() == MPI.COMM_WORLD.Get_size()
    return train(hvd_compress.TernGrad(**TERNGRAD), "sharded")


def test_mpirun_with_mpi4py_communicator():
    results = run_parallel(_train_on_mpi4py_comm, 2, launcher="mpirun", timeout=180)
    assert [r["rank"] for r in results] == [0, 1]
    check_consistent_and_exact(results, hvd_compress.TernGrad(**TERNGRAD))
    assert torch.isfinite(results[0]["records"][-1]["params"]).all()
