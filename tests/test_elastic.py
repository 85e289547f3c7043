"""Horovod elastic: a dist-EF-blockSGDM job changes its world twice mid-training and
finishes. Workers that stay carry their residual mass into each new world, flat or on new
nodes; a worker that joins meets the others at its first step."""

import os
import subprocess

import pytest
import torch

from .harness import BIN, REPO, job_env

pytestmark = pytest.mark.multiprocess

STEPS = 12
# name: (exchange, [(hosts, ranks), ...]): the world at the start, then after each change
# (at steps 4 and 8). Flat sharded exchanges on one host, losing a worker and gaining one;
# two-level ones on hosts that all are this machine to horovodrun (names that resolve to
# 127.0.0.1), losing a host twice: from 3 nodes of 2 to 2 (residuals rescaled by N' / M and
# moved to the new nodes' shards), then to 1 (nothing compressed any more: the next step
# sends the residuals).
WORLDS = {
    "flat": ("sharded", [("localhost:3", 3), ("localhost:2", 2), ("localhost:3", 3)]),
    "two-level": (
        "two-level",
        [
            ("localhost:2,127.0.0.1:2,LOCALHOST:2", 6),
            ("localhost:2,127.0.0.1:2", 4),
            ("localhost:2", 2),
        ],
    ),
}
CHANGE_STEPS = (4, 8)
# The nodes' process sets after each change of the two-level job.
NODES_AFTER = ([[0, 1], [2, 3]], [[0, 1]])


def _check_change(exchange, changed, ranks_before, ranks_after):
    """What each worker that stayed through one change saw at its reset."""
    assert len(changed) == min(ranks_before, ranks_after)
    assert all(seen["world"] == ranks_after for seen in changed)
    befores = [seen["before"] for seen in changed]
    afters = [seen["after"] for seen in changed]
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


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", WORLDS)
def test_changed_worlds_keep_the_residual_mass_of_the_workers_that_stay(tmp_path, layout):
    exchange, worlds = WORLDS[layout]
    (hosts, ranks), *after = worlds
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
        str(max(ranks for _, ranks in worlds)),
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
        str(STEPS),
        exchange,
    ] + [f"{step}={hosts}" for step, (hosts, _) in zip(CHANGE_STEPS, after)]
    job = subprocess.run(
        command,
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    for change, ((_, ranks_before), (_, ranks_after)) in enumerate(zip(worlds, after)):
        changed = [
            torch.load(path, weights_only=False)
            for path in tmp_path.glob(f"change{change}_rank*.pt")
        ]
        _check_change(exchange, changed, ranks_before, ranks_after)
        if exchange == "two-level":
            assert all(seen["nodes"] == NODES_AFTER[change] for seen in changed)

    final = after[-1][1]
    finished = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(final)]
    # The world of every step, as the workers that stayed throughout saw it: every step ran
    # once (no change lost a step); a worker that joined started at the step the others had
    # reached.
    expected = []
    for begin, end, (_, ranks) in zip((0,) + CHANGE_STEPS, CHANGE_STEPS + (STEPS,), worlds):
        expected += [ranks] * (end - begin)
    for result in finished:
        assert result["size"] == final
        assert result["sizes"] == expected[-len(result["sizes"]) :]
        assert len(result["sizes"]) in (STEPS, STEPS - CHANGE_STEPS[-1])
    assert sum(len(result["sizes"]) == STEPS for result in finished) == min(
        ranks for _, ranks in worlds
    )
    if exchange == "two-level":
        # On one node nothing is compressed any more, and the first step sent the residuals.
        assert all(r["nodes"] == [[0, 1]] and r["residuals"] == [] for r in finished)
    for result in finished[1:]:
        assert torch.equal(result["params"], finished[0]["params"])
