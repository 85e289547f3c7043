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

Bodies share jobs: the ranks of a Gloo job stay up and run one body after another, so a
test module pays Horovod's start-up once per world size and launcher instead of once per
test. A job serves the bodies of one test module (``close_shared_jobs`` ends it when the
module is done, and before a job of another key starts, so that idle ranks never compete
for the cores); a body that fails on any rank, or hangs, ends its job and the next body gets
a new one. A body that changes what a process keeps for good (environment variables read
at ``hvd.init``, process sets registered there, an MPI communicator) passes ``own_job=True``
and gets processes of its own.

Gloo ranks are forked from zygotes (``tests.zygote``) that imported torch, TensorFlow, Keras
and numba once for the session, so no job pays those imports; a body that must import a
module differently (Keras 2 under ``TF_USE_LEGACY_KERAS``) passes ``new_interpreter=True``.
"""

import atexit
import importlib
import itertools
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from . import zygote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ``run_parallel``'s launcher of M nodes of L ranks each, on this machine: "2x2".
_NODES = re.compile(r"[1-9][0-9]*x[1-9][0-9]*")
BIN = os.path.dirname(sys.executable)


def run_parallel(
    body,
    np,
    *args,
    launcher="local",
    timeout=300,
    own_job=False,
    new_interpreter=False,
    survivors=False,
    **kwargs,
):
    """Runs ``body(*args, **kwargs)`` on ``np`` ranks; returns the results in rank order.
    ``launcher``: "local" (every rank on localhost, over Gloo), "MxL" (M hosts of L ranks,
    all on this machine) or "mpirun". Gloo bodies run in the test module's shared job of
    ``np`` ranks on ``launcher`` unless ``own_job``; ``timeout`` bounds this body alone.
    Gloo ranks are forked from the zygotes (``tests.zygote``) unless ``new_interpreter``
    (which implies ``own_job``): for a body that must import what the zygotes have not.
    With ``survivors`` (a Gloo job of its own), a rank that dies leaves the others running
    and its result None, where ``horovodrun`` would kill them: for tests of what they do."""
    if launcher != "mpirun" and not (own_job or new_interpreter or survivors):
        key = (body.__module__, np, launcher)
        return _shared_job(key).run(body, args, kwargs, timeout)
    close_shared_jobs()  # idle ranks would compete with this job's for the cores
    workdir = tempfile.mkdtemp(prefix="hvdc-job-")
    try:
        job = os.path.join(workdir, "job.pkl")
        _write(job, (body.__module__, body.__qualname__, args, kwargs))
        worker = [sys.executable, "-m", "tests.harness", job]
        if launcher == "mpirun":
            command = mpirun_command(np) + worker
        else:
            fork = [] if new_interpreter else ["--fork", _zygotes(np)]
            hosts = [_gloo_hosts(launcher, np), str(timeout)]
            keep_going = ["--keep-going"] if survivors else []
            command = [sys.executable, "-m", "tests.nodes"] + keep_going + fork + hosts + worker
        run_job(command, f"{body.__qualname__} on {np} ranks", timeout, check=not survivors)
        results = [os.path.join(workdir, f"rank{rank}.pkl") for rank in range(np)]
        return [_load(p) if os.path.exists(p) or not survivors else None for p in results]
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
    """The environment of a job's processes: one thread each, TensorFlow's log quiet, Horovod's
    background loop at a 5 ms cycle, and the checkout importable as ``tests``.

    Each rank's background loop wakes once a cycle, idle or not, and talks to the other ranks:
    at Horovod's default cycle an idle rank takes about 8% of a core, at 5 ms half that, which
    the 2-4 ranks of a job on 2 cores give back to the test's work (docs/testing.md)."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        HOROVOD_CYCLE_TIME="5",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    )


def run_job(command, what, timeout, cwd=REPO, env=None, check=True):
    """Runs ``command`` (a launcher and its processes) in its own process group with
    ``job_env()`` or ``env``; returns its output. A non-zero exit fails the test with the
    output's error lines (if ``check``); a job still running after ``timeout`` seconds is
    killed, group and all, and fails it as a hang."""
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
    if check and process.returncode != 0:
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


# A shared job's lifetime bound: the longest a test module keeps one (its bodies' own
# timeouts end a hang long before).
SHARED_JOB_SECONDS = 3600
# How often an idle rank looks for its next body, and the test process for results.
POLL_SECONDS = 0.01
# After one rank fails, how long the others have to report their own errors before the job
# is killed (they may be waiting for the failed rank in a collective).
GRACE_SECONDS = 2.0

_shared = {}


class SharedJob:
    """A Gloo job of ``np`` ranks serving bodies from ``directory``: body k is the file
    ``k.job``, rank r answers with ``k.rank<r>``."""

    def __init__(self, np, launcher):
        self.np = np
        self.directory = tempfile.mkdtemp(prefix="hvdc-shared-")
        # Open for the job's life: every rank writes to it, ``tail`` reads it.
        self.log = open(os.path.join(self.directory, "ranks.log"), "w+")  # noqa: SIM115
        self.count = 0
        command = [
            sys.executable,
            "-m",
            "tests.nodes",
            "--fork",
            _zygotes(np),
            _gloo_hosts(launcher, np),
            str(SHARED_JOB_SECONDS),
            sys.executable,
            "-m",
            "tests.harness",
            "--serve",
            self.directory,
            str(os.getpid()),
        ]
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=job_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def run(self, body, args, kwargs, timeout):
        what = f"{body.__qualname__} on {self.np} ranks (shared job, body {self.count})"
        _write(
            os.path.join(self.directory, f"{self.count}.job"),
            (body.__module__, body.__qualname__, args, kwargs),
        )
        answers = [os.path.join(self.directory, f"{self.count}.rank{r}") for r in range(self.np)]
        self.count += 1
        deadline = time.monotonic() + timeout
        loaded, ended_at = {}, None
        while len(loaded) < self.np:
            for rank, answer in enumerate(answers):
                if rank not in loaded and os.path.exists(answer):
                    loaded[rank] = _load(answer)
            now = time.monotonic()
            failed = any(status == "error" for status, _ in loaded.values())
            if ended_at is None and (failed or self.process.poll() is not None):
                ended_at = now
            if ended_at is not None and now > ended_at + GRACE_SECONDS:
                break
            if now > deadline:
                tail = self.tail()
                self.close()
                raise AssertionError(f"{what} timed out after {timeout}s (a hang?):\n{tail}")
            time.sleep(POLL_SECONDS)
        answered = [loaded.get(rank, ("error", "no answer")) for rank in range(self.np)]
        errors = [(r, text) for r, (status, text) in enumerate(answered) if status == "error"]
        if errors:
            tail = self.tail()
            self.close()
            raise AssertionError(
                f"{what} failed:\n"
                + "\n".join(f"rank {r}: {text}" for r, text in errors)
                + f"\n...\n{tail}"
            )
        return [result for _, result in answered]

    def tail(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def close(self):
        _kill_group(self.process)
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _write(path, value):
    """Pickles ``value`` to ``path`` whole or not at all: the reader polls for the name."""
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.rename(path + ".tmp", path)


def _load(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _shared_job(key):
    """The running job of ``key`` (module, np, launcher), started if needed; any other job
    is closed first."""
    job = _shared.get(key)
    if job is not None and job.process.poll() is None:
        return job
    close_shared_jobs()
    _shared[key] = SharedJob(*key[1:])
    return _shared[key]


# The zygotes of the rank slots started so far, their sockets and log in one directory.
_zygotes_started = {"directory": None, "processes": [], "log": None}


def _zygotes(np):
    """The directory of the zygotes of rank slots 0 to ``np - 1`` (``tests.zygote``), each
    started at its first use."""
    started = _zygotes_started
    if started["directory"] is None:
        started["directory"] = tempfile.mkdtemp(prefix="hvdc-zygotes-")
        started["log"] = open(  # noqa: SIM115 (open while the zygotes live)
            os.path.join(started["directory"], "zygotes.log"), "w+"
        )
    slots = range(len(started["processes"]), np)
    started["processes"] += zygote.start(
        started["directory"], slots, job_env(), REPO, started["log"]
    )
    return started["directory"]


def _kill_group(process):
    """Kills ``process`` (a session leader) and its group, if it still runs, and reaps it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _stop_zygotes():
    for process in _zygotes_started["processes"]:
        _kill_group(process)
    if _zygotes_started["directory"] is not None:
        shutil.rmtree(_zygotes_started["directory"], ignore_errors=True)


def close_shared_jobs():
    """Ends every shared job (at the end of each test module, and before another starts)."""
    while _shared:
        _shared.popitem()[1].close()


atexit.register(_stop_zygotes)
atexit.register(close_shared_jobs)


def _serve(directory, owner):
    """A rank of a shared job: runs body after body until the job is killed, its directory
    removed or its owner (the test process, pid ``owner``) gone. A body that fails ends this
    rank, since the others may be left waiting in a collective that it will never join."""
    frameworks = set()
    for count in itertools.count():
        job = os.path.join(directory, f"{count}.job")
        while not os.path.exists(job):
            if not os.path.isdir(directory) or not zygote.alive(owner):
                return
            time.sleep(POLL_SECONDS)
        answer = os.path.join(directory, f"{count}.rank{_rank()}")
        try:
            result = ("ok", _call(job))
            loaded = {m for m in ("horovod.torch", "horovod.tensorflow") if m in sys.modules}
            if frameworks and loaded != frameworks:
                raise RuntimeError(
                    f"this body loaded {sorted(loaded - frameworks)} into a job of "
                    f"{sorted(frameworks)} bodies: run it with own_job=True"
                )
            frameworks = loaded
        except BaseException:
            result = ("error", traceback.format_exc())
        _write(answer, result)
        if result[0] == "error":
            sys.exit(1)


def _call(job):
    """Runs the body that ``job`` (a pickle of module, qualname, args and kwargs) names."""
    with open(job, "rb") as f:
        module, qualname, args, kwargs = pickle.load(f)
    body = importlib.import_module(module)
    for part in qualname.split("."):
        body = getattr(body, part)
    return body(*args, **kwargs)


def _rank():
    for variable in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    raise RuntimeError("cannot tell this process's rank from the environment")


def _main(job):
    _write(os.path.join(os.path.dirname(job), f"rank{_rank()}.pkl"), _call(job))


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve(sys.argv[2], int(sys.argv[3]))
    else:
        _main(sys.argv[1])
