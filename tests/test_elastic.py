"""Horovod elastic: a dist-EF-blockSGDM job changes its world mid-training and finishes. Workers
that stay carry their residual mass into the new world, flat or on new nodes; a worker that
joins meets the others at its first step."""

import os
import subprocess

import pytest
import torch

from .harness import BIN, REPO

pytestmark = pytest.mark.multiprocess


# name: (exchange, hosts before, hosts after, ranks before, ranks after). Flat sharded
# exchanges on one host, losing a worker and gaining one; two-level ones on hosts that all
# are this machine to horovodrun (names that resolve to 127.0.0.1), losing a host: from 3
# nodes of 2 to 2 (residuals rescaled by N' / M and moved to the new nodes' shards), and
# from 2 nodes to 1 (nothing compressed any more: the next step sends the residuals).
LAYOUTS = {
    "flat": ("sharded", "localhost:3", "localhost:2", 3, 2),
    "flat-growing": ("sharded", "localhost:2", "localhost:3", 2, 3),
    "two-level": (
        "two-level",
        "localhost:2,127.0.0.1:2,LOCALHOST:2",
        "localhost:2,127.0.0.1:2",
        6,
        4,
    ),
    "two-level-to-one-node": ("two-level", "localhost:2,127.0.0.1:2", "localhost:2", 4, 2),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_changed_world_keeps_the_residual_mass_of_the_workers_that_stay(tmp_path, layout):
    exchange, hosts, hosts_after, ranks, ranks_after = LAYOUTS[layout]
    steps, change_at = 12, 5
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
        str(max(ranks, ranks_after)),
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
        str(change_at),
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
        timeout=300,
        start_new_session=True,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    finished = [
        torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(ranks_after)
    ]
    # Workers that joined started at the step the others had reached, and saw no reset.
    stayed = [result for result in finished if result["seen"]["before"] is not None]
    assert len(stayed) == min(ranks, ranks_after)
    for result in finished:
        assert result["size"] == ranks_after
        sizes = result["seen"]["sizes"]
        assert sizes[-(steps - change_at) :] == [ranks_after] * (steps - change_at)
    for result in stayed:
        sizes = result["seen"]["sizes"]
        assert sizes[:change_at] == [ranks] * change_at
        assert len(sizes) == steps  # every step ran once: the change lost no step
        assert result["seen"]["after_world"] == ranks_after
    befores = [result["seen"]["before"] for result in stayed]
    afters = [result["seen"]["after"] for result in stayed]
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
