"""A Slurm cluster of this machine alone, for the launcher tests: MUNGE, ``slurmctld`` and
``slurmd`` (Debian's slurm-wlm) started in a temporary directory with a configuration of
their own, and stopped, on leaving the ``with`` block.

    with SlurmCluster() as cluster:
        subprocess.run(["sbatch", "--wait", "launch/slurm-cpu.sbatch", ...], env=cluster.env())

Every path, port and key is the run's own (nothing under /etc or /var is touched): the
daemons run as root, the one node is this machine with its cores, and the processes of a
job are tracked without cgroups (``proctrack/linuxproc``), which a container may not
delegate. Needs root.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
# Ports of their own, so that a Slurm the machine may run is not disturbed.
CONTROLLER_PORT, NODE_PORT = 16817, 16818
START_SECONDS = 30


def unavailable_reason():
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster of its own needs root (its daemons run as root)"
    missing = [name for name in DAEMONS + ("sbatch", "mungekey") if shutil.which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} missing (Debian's slurmctld, slurmd, slurm-client and munge: "
            "make setup-launchers)"
        )
    return None


class SlurmCluster:
    """One node (this machine, ``os.cpu_count()`` CPUs, tasks oversubscribing them) in one
    partition, ``cpu``."""

    def __init__(self):
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"SlurmCluster: {reason}")
        self.directory = None
        self.node = socket.gethostname()

    def env(self, env=None):
        """``env`` (default this process's) with ``SLURM_CONF`` naming this cluster's
        configuration, which Slurm's commands read."""
        return dict(os.environ if env is None else env, SLURM_CONF=self._path("slurm.conf"))

    def __enter__(self):
        self.directory = tempfile.mkdtemp(prefix="hvdc-slurm-")
        try:
            for name in ("state", "spool", "log"):
                os.makedirs(self._path(name))
            self._write_config()
            subprocess.run(
                ["mungekey", "--create", "--keyfile", self._path("munge.key")], check=True
            )
            subprocess.run(
                [
                    "munged",
                    "--force",  # as root
                    f"--key-file={self._path('munge.key')}",
                    f"--socket={self._path('munge.socket')}",
                    f"--pid-file={self._path('munged.pid')}",
                    f"--log-file={self._path('log', 'munged.log')}",
                    f"--seed-file={self._path('munged.seed')}",
                ],
                check=True,
            )
            for daemon in ("slurmctld", "slurmd"):
                subprocess.run([daemon, "-f", self._path("slurm.conf")], check=True, env=self.env())
            self._wait_until_idle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.directory is None:
            return
        # A job still running (a test that failed or timed out) goes with the cluster.
        subprocess.run(["scancel", "--user", "root"], env=self.env(), capture_output=True)
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            self._stop(self._path(pid_file))
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

    def log(self, daemon):
        """The end of ``daemon``'s log, for a failure's message."""
        path = self._path("log", f"{daemon}.log")
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read()[-3000:]

    def _path(self, *parts):
        return os.path.join(self.directory, *parts)

    def _write_config(self):
        settings = {
            "ClusterName": "hvdc",
            "SlurmctldHost": self.node,
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self._path('munge.socket')}",
            "SlurmctldPort": CONTROLLER_PORT,
            "SlurmdPort": NODE_PORT,
            "StateSaveLocation": self._path("state"),
            "SlurmdSpoolDir": self._path("spool"),
            "SlurmctldPidFile": self._path("slurmctld.pid"),
            "SlurmdPidFile": self._path("slurmd.pid"),
            "SlurmctldLogFile": self._path("log", "slurmctld.log"),
            "SlurmdLogFile": self._path("log", "slurmd.log"),
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "SchedulerType": "sched/builtin",
        }
        with open(self._path("slurm.conf"), "w") as f:
            for key, value in settings.items():
                f.write(f"{key}={value}\n")
            f.write(f"NodeName={self.node} CPUs={os.cpu_count()} State=UNKNOWN\n")
            # More tasks than cores, as the other multi-process tests run them.
            f.write(
                f"PartitionName=cpu Nodes={self.node} Default=YES MaxTime=INFINITE "
                "State=UP OverSubscribe=FORCE:4\n"
            )

    def _wait_until_idle(self):
        deadline = time.monotonic() + START_SECONDS
        while True:
            state = subprocess.run(
                ["sinfo", "--noheader", "--format=%t"],
                env=self.env(),
                capture_output=True,
                text=True,
            ).stdout.strip()
            if state == "idle":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SlurmCluster: the node is {state!r}, not idle, after {START_SECONDS} s:\n"
                    f"{self.log('slurmctld')}\n{self.log('slurmd')}"
                )
            time.sleep(0.2)

    @staticmethod
    def _stop(pid_file, seconds=10):
        """Terminates the daemon of ``pid_file`` and waits for it to go."""
        try:
            with open(pid_file) as f:
                pid = int(f.read())
            os.kill(pid, 15)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                return
            time.sleep(0.05)
        os.kill(pid, 9)
