"""Horovod elastic: a 3-worker dist-EF-blockSGDM job loses a worker mid-training and finishes,
and the residual mass the survivors hold is carried into the smaller world."""

import os
import subprocess

import pytest
import torch

from .harness import BIN, REPO

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(900)
def test_losing_one_of_three_workers_keeps_the_survivors_residual_mass(tmp_path):
    steps, shrink_at = 12, 5
    (tmp_path / "hosts").write_text("localhost:3\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    command = [
        os.path.join(BIN, "horovodrun"),
        "-np",
        "3",
        "--min-np",
        "2",
        "--max-np",
        "3",
        "--host-discovery-script",
        str(discover),
        "--gloo-timeout-seconds",
        "120",
        # One host: elastic mode cannot compare interfaces across hosts, so name it.
        "--network-interface",
        "lo",
        os.path.join(BIN, "python"),
        "-m",
        "tests.elastic_train",
        str(tmp_path),
        str(steps),
        str(shrink_at),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    job = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
        start_new_session=True,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    finished = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for result in finished:
        assert result["size"] == 2
        sizes = result["seen"]["sizes"]
        assert sizes[:shrink_at] == [3] * shrink_at and set(sizes[shrink_at:]) == {2}
        assert len(sizes) == steps  # every step ran once: the shrink lost no step
        before, after = result["seen"]["before"], result["seen"]["after"]
        assert result["seen"]["after_world"] == 2 and before.keys() == after.keys() and before
        for name in before:
            torch.testing.assert_close(after[name], before[name], rtol=1e-6, atol=1e-7)
    assert torch.equal(finished[0]["params"], finished[1]["params"])
