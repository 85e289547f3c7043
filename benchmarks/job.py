"""A Horovod job over Gloo started without ssh or ``horovodrun``: Horovod's own rendezvous
server, and each worker given the environment ``horovodrun --gloo`` would have set.

    with HorovodJob(NamespacedHosts(network), [python, "train.py"]) as job:
        ...job.rank0 is rank 0's process...

``NamespacedHosts`` puts the workers in the node namespaces of a ``TestNetwork`` (the
rendezvous server runs in the switch namespace); ``LocalHosts`` runs every worker on this
machine's loopback, the fallback when namespaces cannot be created. Every worker is started
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

    shaped = True

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


class LocalHosts:
    """Every worker on this machine's loopback, unshaped; placed on ``hosts``
    (``"nodeA:2,nodeB:2"``: Horovod's local and cross ranks as on two nodes) or all on
    localhost."""

    shaped = False

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


class HorovodJob:
    """``command`` on every worker of ``hosts``.

    Args:
        hosts: ``NamespacedHosts`` or ``LocalHosts``.
        command: the worker program and its arguments.
        env: extra environment variables for every worker.
        rank0_pipes: give rank 0 a pipe for stdin and stdout (``job.rank0``) instead of
            this process's; the other ranks' output goes to ``log`` (or is inherited).
        log: a file that receives the output of ranks other than 0.
    """

    def __init__(self, hosts, command, env=None, rank0_pipes=False, log=None):
        self.hosts, self.command = hosts, list(command)
        self.env, self.rank0_pipes, self.log = dict(env or {}), rank0_pipes, log
        self.processes = []
        self.rendezvous = None
        self.rank0 = None

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
        self.rank0 = self.processes[0]

    def _spawn(self, rank, env):
        """Starts worker ``rank`` with ``env`` in its own session; returns its process."""
        pipes = self.rank0_pipes and rank == 0
        return subprocess.Popen(
            self.hosts.worker_prefix(rank) + self.command,
            cwd=REPO,
            env=env,
            start_new_session=True,
            text=True,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else self.log,
            stderr=None if pipes or self.log is None else subprocess.STDOUT,
        )

    def _base_env(self):
        return dict(
            os.environ,
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
            **self.env,
            PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        )

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
