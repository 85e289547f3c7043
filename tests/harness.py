"""Runs a test body in N real Horovod processes and returns every rank's result.

    results = run_parallel(body, 2, arg, key=value)   # -> [rank 0's result, rank 1's, ...]

``body`` is a module-level function of an importable module (``tests.<file>``); it calls
``hvd.init()`` itself, so one harness serves PyTorch, TensorFlow and mpi4py bodies. Each job
runs under a hard timeout in its own process group, so a hang fails the test instead of the
whole CI run. Every rank's process gets one thread (``OMP_NUM_THREADS=1``).

Gloo jobs start their ranks with the environment ``horovodrun --gloo -H`` gives them and
Horovod's own rendezvous server (``tests.nodes``), without ``horovodrun``: its start-up
imports TensorFlow and costs seconds per job, over a hundred times a suite.
``horovodrun`` itself runs in the tests of the README's commands, the demo and elastic
training.
"""

import importlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ``run_parallel``'s launcher of M nodes of L ranks each, on this machine: "2x2".
_NODES = re.compile(r"[1-9][0-9]*x[1-9][0-9]*")
BIN = os.path.dirname(sys.executable)


def run_parallel(body, np, *args, launcher="local", timeout=300, **kwargs):
    """Runs ``body(*args, **kwargs)`` on ``np`` ranks; returns the results in rank order.
    ``launcher``: "local" (every rank on localhost, over Gloo), "MxL" (M hosts of L ranks,
    all on this machine) or "mpirun"."""
    workdir = tempfile.mkdtemp(prefix="hvdc-job-")
    try:
        job = os.path.join(workdir, "job.pkl")
        with open(job, "wb") as f:
            pickle.dump((body.__module__, body.__qualname__, args, kwargs), f)
        worker = [sys.executable, "-m", "tests.harness", job]
        if launcher == "mpirun":
            command = mpirun_command(np) + worker
        else:
            hosts = _gloo_hosts(launcher, np)
            command = [sys.executable, "-m", "tests.nodes", hosts, str(timeout)] + worker
        run_job(command, f"{body.__qualname__} on {np} ranks", timeout)
        results = []
        for rank in range(np):
            with open(os.path.join(workdir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _gloo_hosts(launcher, np):
    """The ``horovodrun -H`` hosts of a Gloo ``launcher`` of ``np`` ranks."""
    if launcher == "local":
        return f"localhost:{np}"
    if not _NODES.fullmatch(launcher):
        raise ValueError(
            f"launcher must be 'local', 'mpirun' or 'MxL' (M nodes of L ranks), got {launcher!r}"
        )
    nodes, local = map(int, launcher.split("x"))
    if nodes * local != np:
        raise ValueError(f"launcher {launcher!r} places {nodes * local} ranks, not {np}")
    return ",".join(f"node{k}:{local}" for k in range(nodes))


def job_env():
    """The environment of a job's processes: one thread each, TensorFlow's log quiet, and the
    checkout importable as ``tests``."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    )


def run_job(command, what, timeout, cwd=REPO, env=None):
    """Runs ``command`` (a launcher and its processes) in its own process group with
    ``job_env()`` or ``env``; returns its output. A non-zero exit fails the test with the
    output's error lines; a job still running after ``timeout`` seconds is killed, group and
    all, and fails it as a hang."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=job_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(
            f"{what} timed out after {timeout}s (a hang?):\n{output[-6000:]}"
        ) from None
    if process.returncode != 0:
        errors = [line for line in output.splitlines() if "Error" in line][:10]
        raise AssertionError(
            f"{what} failed (exit {process.returncode}):\n"
            + "\n".join(errors)
            + f"\n...\n{output[-6000:]}"
        )
    return output


def mpirun_command(np):
    """OpenMPI's mpirun for ``np`` local ranks; see launch/mpirun.sh for each flag."""
    command = [
        shutil.which("mpirun") or "mpirun",
        "-np",
        str(np),
        "--oversubscribe",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "-x",
        "OMP_NUM_THREADS",
        "-x",
        "PYTHONPATH",
        "-x",
        "TF_CPP_MIN_LOG_LEVEL",
        "--mca",
        "btl",
        "self,tcp",
    ]
    if os.geteuid() == 0:
        command.insert(1, "--allow-run-as-root")
    return command


def _rank():
    for variable in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    raise RuntimeError("cannot tell this process's rank from the environment")


def _main(job):
    with open(job, "rb") as f:
        module, qualname, args, kwargs = pickle.load(f)
    body = importlib.import_module(module)
    for part in qualname.split("."):
        body = getattr(body, part)
    result = body(*args, **kwargs)
    with open(os.path.join(os.path.dirname(job), f"rank{_rank()}.pkl"), "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    _main(sys.argv[1])
