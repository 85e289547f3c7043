"""Horovod elastic: a dist-EF-blockSGDM job loses workers mid-training and finishes, and the
residual mass the survivors hold is carried into the smaller world, flat or on new nodes."""

import os
import subprocess

import pytest
import torch

from .harness import BIN, REPO

pytestmark = pytest.mark.multiprocess


# name: (exchange, hosts before, hosts after, ranks before, ranks after). A flat sharded
# exchange on one host; two-level ones on hosts that all are this machine to horovodrun
# (names that resolve to 127.0.0.1), losing a host: from 3 nodes of 2 to 2 (residuals
# rescaled by N' / M and moved to the new nodes' shards), and from 2 nodes to 1 (nothing
# compressed any more: the next step sends the residuals).
LAYOUTS = {
    "flat": ("sharded", "localhost:3", "localhost:2", 3, 2),
    "two-level": (
        "two-level",
        "localhost:2,127.0.0.1:2,LOCALHOST:2",
        "localhost:2,127.0.0.1:2",
        6,
        4,
    ),
    "two-level-to-one-node": ("two-level", "localhost:2,127.0.0.1:2", "localhost:2", 4, 2),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_losing_workers_keeps_the_survivors_residual_mass(tmp_path, layout):
    exchange, hosts, hosts_after, ranks, survivors = LAYOUTS[layout]
    steps, shrink_at = 12, 5
    (tmp_path / "hosts").write_text(hosts.replace(",", "\n") + "\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    command = [
        os.path.join(BIN, "horovodrun"),
        "-np",
        str(ranks),
        "--min-np",
        "2",
        "--max-np",
        str(ranks),
        "--host-discovery-script",
        str(discover),
        "--gloo-timeout-seconds",
        "120",
        # One machine: elastic mode cannot compare interfaces across hosts, so name it.
        "--network-interface",
        "lo",
        os.path.join(BIN, "python"),
        "-m",
        "tests.elastic_train",
        str(tmp_path),
        str(steps),
        str(shrink_at),
        exchange,
        hosts_after,
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

    finished = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(survivors)]
    for result in finished:
        assert result["size"] == survivors
        sizes = result["seen"]["sizes"]
        assert sizes[:shrink_at] == [ranks] * shrink_at and set(sizes[shrink_at:]) == {survivors}
        assert len(sizes) == steps  # every step ran once: the shrink lost no step
        assert result["seen"]["after_world"] == survivors
    befores = [result["seen"]["before"] for result in finished]
    afters = [result["seen"]["after"] for result in finished]
    assert befores[0] and all(m.keys() == befores[0].keys() for m in befores + afters)
    for name in befores[0]:
        if exchange == "two-level":
            # The new node's average mixes its ranks' residuals: the survivors' sum holds.
            before = sum(mass[name] for mass in befores)
            after = sum(mass[name] for mass in afters)
            torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-7)
            assert before.abs().sum() > 0
        else:
            for before, after in zip(befores, afters):
                torch.testing.assert_close(after[name], before[name], rtol=1e-6, atol=1e-7)
    if layout == "two-level":
        assert all(r["nodes"] == [[0, 1], [2, 3]] and r["residuals"] for r in finished)
    if layout == "two-level-to-one-node":
        # Nothing is compressed any more, and the first step sent the residuals.
        assert all(r["nodes"] == [[0, 1]] and r["residuals"] == [] for r in finished)
    for result in finished[1:]:
        assert torch.equal(result["params"], finished[0]["params"])
