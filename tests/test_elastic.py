"""Horovod elastic: a dist-EF-blockSGDM job changes its world twice mid-training and
finishes, in PyTorch and in Keras ``fit`` (``hvd_compress.tf.elastic.KerasState``). Workers
that stay carry their residual mass into each new world, flat or on new nodes; a worker that
joins meets the others at its first step."""

import os
import pickle
import subprocess

import numpy as np
import pytest
import torch

from .harness import BIN, REPO, job_env

pytestmark = pytest.mark.multiprocess

STEPS = 12
# name: (job and its arguments, [(hosts, ranks), ...]): the world at the start, then after
# each change (at steps 4 and 8); a job's last argument is its exchange. Flat sharded
# exchanges on one host, losing a worker and gaining one, in PyTorch and in Keras (fit and a
# tape loop); two-level ones on hosts that all are this machine to horovodrun (names that
# resolve to 127.0.0.1), losing a host twice: from 3 nodes of 2 to 2 (residuals rescaled by
# N' / M and moved to the new nodes' shards), then to 1 (nothing compressed any more: the next
# step sends the residuals).
FLAT = [("localhost:3", 3), ("localhost:2", 2), ("localhost:3", 3)]
WORLDS = {
    "flat": (["tests.elastic_train", "sharded"], FLAT),
    "keras-fit": (["tests.elastic_train_keras", "fit", "sharded"], FLAT),
    "keras-tape": (["tests.elastic_train_keras", "tape", "sharded"], FLAT),
    "two-level": (
        ["tests.elastic_train", "two-level"],
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


def _load(path):
    """What a job wrote: PyTorch's ``.pt`` (torch.save) or Keras's ``.pkl`` (pickle, numpy
    arrays), with every tensor as a numpy array."""
    if path.suffix == ".pkl":
        with open(path, "rb") as f:
            return pickle.load(f)
    seen = torch.load(path, weights_only=False)
    return {
        key: {k: v.numpy() for k, v in value.items()}
        if key in ("before", "after")
        else value.numpy()
        if isinstance(value, torch.Tensor)
        else value
        for key, value in seen.items()
    }


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
            np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)
            assert np.abs(before).sum() > 0
        else:
            for before, after in zip(befores, afters):
                np.testing.assert_allclose(after[name], before[name], rtol=1e-6, atol=1e-7)
    # Mass to carry: conservation of nothing would hold whatever the change did.
    assert sum(np.abs(m).sum() for seen in befores for m in seen.values()) > 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", WORLDS)
def test_changed_worlds_keep_the_residual_mass_of_the_workers_that_stay(tmp_path, layout):
    (job, *arguments), worlds = WORLDS[layout]
    exchange = arguments[-1]
    suffix = ".pkl" if job == "tests.elastic_train_keras" else ".pt"
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
        job,
        str(tmp_path),
        str(STEPS),
        *arguments,
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
        changed = [_load(path) for path in tmp_path.glob(f"change{change}_rank*{suffix}")]
        _check_change(exchange, changed, ranks_before, ranks_after)
        if exchange == "two-level":
            assert all(seen["nodes"] == NODES_AFTER[change] for seen in changed)

    final = after[-1][1]
    finished = [_load(tmp_path / f"rank{r}{suffix}") for r in range(final)]
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
        np.testing.assert_array_equal(result["params"], finished[0]["params"])
