"""The benchmark's Horovod jobs over Gloo, and the hosts they run on.

    with hosts.job([python, "train.py"], env, log) as job:
        for line in job.output: ...       # rank 0's lines (horovodrun's: every rank's)
        job.wait(timeout)

``SshLaunchedHosts`` are the nodes of a ``TestNetwork`` that answer over ssh
(``benchmarks.ssh_hosts``): ``horovodrun --gloo -H`` starts the job from node 0
(``HorovodrunJob``) and derives every rank's local and cross ranks itself, as on a cluster.
``NamespacedHosts`` (a node namespace per worker) and ``LocalHosts`` (every worker on this
machine's loopback, the fallback when namespaces cannot be created) start their workers
without ssh or ``horovodrun`` (``HorovodJob``): Horovod's own rendezvous server, and each
worker given the environment ``horovodrun --gloo`` would have set. Every worker is started
in its own process group, and leaving the ``with`` block kills the ones still running.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch.distributed's rendezvous (DDP baselines) on rank 0's address.
DDP_PORT = 29533
POLL_SECONDS = 0.2


class NamespacedHosts:
    """The workers of ``network`` (a ``TestNetwork``) in its node namespaces, each node a
    host with a slot per worker."""

    def __init__(self, network):
        self.network = network
        self.workers = network.workers
        self.interface = "eth0"
        self.rendezvous_address = network.switch_address
        self.ddp_address = network.address(0)

    def hosts(self):
        return ",".join(
            f"{self.network.namespace(k)}:{self.network.per_node}"
            for k in range(self.network.nodes)
        )

    def worker_prefix(self, rank):
        return self.network.exec_prefix(rank)

    def rendezvous_prefix(self):
        return self.network.switch_exec_prefix()

    def job(self, command, env=None, log=None):
        return HorovodJob(self, command, env, rank0_output=True, log=log)


class LocalHosts:
    """Every worker on this machine's loopback, unshaped; placed on ``hosts``
    (``"nodeA:2,nodeB:2"``: Horovod's local and cross ranks as on two nodes) or all on
    localhost."""

    def __init__(self, workers, hosts=None):
        self.workers = workers
        self.interface = "lo"
        self.rendezvous_address = self.ddp_address = "127.0.0.1"
        self._hosts = hosts or f"localhost:{workers}"

    def hosts(self):
        return self._hosts

    def worker_prefix(self, rank):
        return []

    def rendezvous_prefix(self):
        return []

    def job(self, command, env=None, log=None):
        return HorovodJob(self, command, env, rank0_output=True, log=log)


class SshLaunchedHosts:
    """The nodes of ``hosts`` (an entered ``benchmarks.ssh_hosts.SshHosts``), on which
    ``horovodrun`` starts the jobs over ssh."""

    def __init__(self, hosts):
        self.ssh = hosts
        self.workers = hosts.network.workers

    def job(self, command, env=None, log=None):
        return HorovodrunJob(self.ssh, command, env, log)


class HorovodJob:
    """``command`` on every worker of ``hosts``.

    Args:
        hosts: ``NamespacedHosts`` or ``LocalHosts``.
        command: the worker program and its arguments.
        env: extra environment variables for every worker.
        rank0_output: give rank 0's standard output a pipe (``job.output``) instead of
            this process's; the other ranks' output goes to ``log`` (or is inherited).
        log: a file that receives the output of ranks other than 0.
    """

    def __init__(self, hosts, command, env=None, rank0_output=False, log=None):
        self.hosts, self.command = hosts, list(command)
        self.env, self.rank0_output, self.log = dict(env or {}), rank0_output, log
        self.processes = []
        self.rendezvous = None
        self.output = None

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc):
        self.kill()

    def _start(self):
        plan = get_host_assignments(parse_hosts(self.hosts.hosts()), self.hosts.workers)
        self.rendezvous = subprocess.Popen(
            self.hosts.rendezvous_prefix()
            + [
                sys.executable,
                "-m",
                "benchmarks.rendezvous",
                self.hosts.hosts(),
                str(self.hosts.workers),
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=self._base_env(),
        )
        port = self.rendezvous.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError("the Horovod rendezvous server did not start (see its error above)")
        env = self._base_env()
        env.update(create_run_env_vars(self.hosts.rendezvous_address, [self.hosts.interface], port))
        env.update(
            MASTER_ADDR=self.hosts.ddp_address,
            MASTER_PORT=str(DDP_PORT),
            GLOO_SOCKET_IFNAME=self.hosts.interface,
        )
        for slot in plan:
            worker_env = dict(env, **create_slot_env_vars(slot))
            self.processes.append(self._spawn(slot.rank, worker_env))
        if self.rank0_output:
            self.output = self.processes[0].stdout

    def _spawn(self, rank, env):
        """Starts worker ``rank`` with ``env`` in its own session; returns its process."""
        pipe = self.rank0_output and rank == 0
        return subprocess.Popen(
            self.hosts.worker_prefix(rank) + self.command,
            cwd=REPO,
            env=env,
            start_new_session=True,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe else self.log,
            stderr=None if pipe or self.log is None else subprocess.STDOUT,
        )

    def _base_env(self):
        return _worker_env(self.env)

    def wait(self, timeout, stop_at_failure=True):
        """Waits for every worker; kills them all after ``timeout`` seconds or, as
        ``horovodrun`` does, as soon as one fails (unless not ``stop_at_failure``: then
        the others run on, as under a launcher that leaves them). Returns the first nonzero
        exit code (0 if all succeeded)."""
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in self.processes):
            if stop_at_failure and any(process.poll() for process in self.processes):
                break
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the Horovod job did not finish within {timeout:.0f}s")
            time.sleep(POLL_SECONDS)
        self.kill()
        return next((process.returncode for process in self.processes if process.returncode), 0)

    def run(self, timeout, stop_at_failure=True):
        with self:
            return self.wait(timeout, stop_at_failure)

    def kill(self):
        """Kills every worker still running and stops the rendezvous server."""
        for process in self.processes + [self.rendezvous]:
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _worker_env(extra):
    """This process's environment for a worker: one thread, unbuffered output, ``extra``,
    the checkout importable."""
    return dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
        **extra,
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    )


class HorovodrunJob:
    """``command`` on every worker of ``hosts`` (an entered ``benchmarks.ssh_hosts.SshHosts``),
    started by ``horovodrun --gloo -H`` in node 0's namespace, which reaches every node over
    ssh and forwards its environment (``env`` added) to every rank. ``output`` is the
    launcher's: every rank's lines, each prefixed ``[<rank>]<stdout>:``."""

    def __init__(self, hosts, command, env=None, log=None):
        self.hosts, self.command, self.env, self.log = hosts, list(command), env or {}, log
        self.process = None
        self.output = None

    def __enter__(self):
        self.process = subprocess.Popen(
            # The nodes' interface: horovodrun would otherwise probe every node for the
            # interfaces they share, through services it starts over ssh.
            self.hosts.horovodrun("--network-interface", "eth0") + self.command,
            cwd=REPO,
            env=self.hosts.launcher_env(
                _worker_env(
                    dict(
                        self.env,
                        MASTER_ADDR=self.hosts.network.address(0),
                        MASTER_PORT=str(DDP_PORT),
                    )
                )
            ),
            start_new_session=True,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log or subprocess.STDOUT,
        )
        self.output = self.process.stdout
        return self

    def __exit__(self, *exc):
        self.kill()

    def wait(self, timeout):
        """Waits for ``horovodrun``, which ends the job when a rank fails; kills the job
        after ``timeout`` seconds. Returns its exit code."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the Horovod job did not finish within {timeout:.0f}s") from None

    def kill(self):
        """Kills the launcher and, in every node's namespace, the job's ranks that the
        ssh sessions it held may have left running."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        program = " ".join(self.command).encode()
        for node in range(self.hosts.network.nodes):
            for pid in self.hosts.network.pids(node):
                with contextlib.suppress(OSError):
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        running = f.read().replace(b"\0", b" ").strip()
                    if running.endswith(program):
                        os.kill(pid, signal.SIGKILL)
