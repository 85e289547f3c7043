"""Hosts a launcher reaches over ssh, on one machine: every node namespace of a
``TestNetwork`` runs an sshd of its own and answers to a host name, so ``horovodrun -H`` and
``mpirun -H`` start a job on them as on a cluster, and Horovod derives the local and cross
ranks itself.

    with TestNetwork(4, per_node=2) as network, SshHosts(network) as hosts:
        subprocess.run(hosts.launcher_prefix() + ["horovodrun", "-np", "4",
                       "-H", hosts.hosts(), ...], env=hosts.launcher_env())

Node k is ``node<k>`` at ``network.address(k)``, and its sshd runs with that host name (a UTS
namespace of its own: OpenMPI and Horovod's MPI controller tell nodes apart by their host
names, and Horovod's crashed at ``hvd.init`` when two nodes shared one); every namespace's
hosts file names all of them. The keys (one host key, one client key) are made for the run
in a temporary directory, with an ssh configuration that uses them; ``launcher_env`` puts
an ``ssh`` that reads it first on ``PATH``, which is how ``horovodrun`` and OpenMPI's
``mpirun`` find ssh.
The launcher runs in node 0's namespace, as it would on a cluster's first node. Leaving
the ``with`` block stops every sshd and removes the keys. Needs root and Debian's
``openssh-server``.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_PORT = 22
START_SECONDS = 10


def unavailable_reason():
    """Why sshd cannot run here, or None."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing (Debian's openssh-server: apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is missing (Debian's openssh-client)"
    return None


class SshHosts:
    """An sshd in every node namespace of ``network`` (an entered ``TestNetwork``), each
    node a host named ``node<k>``."""

    def __init__(self, network):
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"SshHosts: {reason}")
        self.network = network
        self.directory = None
        self._daemons = []

    def name(self, node):
        return f"node{node}"

    def hosts(self):
        """``horovodrun -H`` / ``mpirun -H``'s list: every node with a slot per worker."""
        return ",".join(
            f"{self.name(k)}:{self.network.per_node}" for k in range(self.network.nodes)
        )

    def horovodrun(self, *options):
        """``horovodrun --gloo`` in node 0's namespace, a rank on every slot of every node,
        with ``options`` (the program and its arguments follow)."""
        launcher = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        hosts = ["-np", str(self.network.workers), "-H", self.hosts()]
        return self.launcher_prefix() + [launcher, "--gloo"] + hosts + list(options)

    def launcher_prefix(self):
        """The command prefix that runs a launcher in node 0's namespace."""
        return self.network.exec_prefix(0)

    def launcher_env(self, env=None):
        """``env`` (default this process's) with this run's ``ssh`` first on ``PATH``."""
        env = dict(os.environ if env is None else env)
        env["PATH"] = os.path.join(self.directory, "bin") + os.pathsep + env.get("PATH", "")
        return env

    def __enter__(self):
        self.directory = tempfile.mkdtemp(prefix="hvdc-ssh-")
        try:
            self._write_keys_and_config()
            self._write_hosts_files()
            for node in range(self.network.nodes):
                self._start_sshd(node)
            for node in range(self.network.nodes):
                self._wait_for(node)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for daemon in self._daemons:
            daemon.terminate()
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                daemon.kill()
        self._daemons.clear()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _path(self, *parts):
        return os.path.join(self.directory, *parts)

    def _write_keys_and_config(self):
        for key in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self._path(key)],
                check=True,
            )
        shutil.copy(self._path("client_key.pub"), self._path("authorized_keys"))
        with open(self._path("ssh_config"), "w") as f:
            f.write(
                "Host node*\n"
                f"    IdentityFile {self._path('client_key')}\n"
                "    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {self._path('known_hosts')}\n"
                "    StrictHostKeyChecking accept-new\n"
                "    BatchMode yes\n"
                "    LogLevel ERROR\n"
            )
        os.makedirs(self._path("bin"))
        wrapper = self._path("bin", "ssh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {SSH} -F {self._path("ssh_config")} "$@"\n')
        os.chmod(wrapper, 0o755)

    def _write_hosts_files(self):
        """Every namespace resolves every node's name; this machine's host name stays
        each node's own address (Gloo resolves it, ``TestNetwork._build``)."""
        names = "".join(
            f"{self.network.address(k)} {self.name(k)}\n" for k in range(self.network.nodes)
        )
        hostname = socket.gethostname()
        for node in range(self.network.nodes):
            with open(f"/etc/netns/{self.network.namespace(node)}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.network.address(node)} {hostname}\n")
                f.write(names)

    def _start_sshd(self, node):
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        options = {
            "ListenAddress": f"{self.network.address(node)}:{SSH_PORT}",
            "HostKey": self._path("host_key"),
            "AuthorizedKeysFile": self._path("authorized_keys"),
            "PidFile": self._path(f"sshd{node}.pid"),
            "PermitRootLogin": "prohibit-password",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "UsePAM": "no",
            # The keys live in a temporary directory that is not the user's home.
            "StrictModes": "no",
            # Launchers start many sessions at once (horovodrun's task services, mpirun's
            # daemons); sshd's default refuses some of them.
            "MaxStartups": "100",
            "MaxSessions": "100",
        }
        command = [SSHD, "-D", "-e", "-f", "/dev/null"]
        for key, value in options.items():
            command += ["-o", f"{key}={value}"]
        with open(self._path(f"sshd{node}.log"), "w") as log:
            self._daemons.append(
                subprocess.Popen(
                    self.network.exec_prefix(node * self.network.per_node)
                    # A host name of its own (a UTS namespace), as a cluster's nodes have:
                    # OpenMPI and Horovod's MPI controller tell the nodes apart by it.
                    + ["unshare", "--uts", "sh", "-c", f'hostname {self.name(node)} && exec "$@"']
                    + ["sh"]
                    + command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def _wait_for(self, node):
        """Waits until ``node`` answers a command over ssh from the launcher's namespace."""
        deadline = time.monotonic() + START_SECONDS
        command = self.launcher_prefix() + ["ssh", self.name(node), "true"]
        while True:
            if self._daemons[node].poll() is not None:
                raise RuntimeError(
                    f"SshHosts: the sshd of {self.name(node)} exited: {self._log(node)}"
                )
            done = subprocess.run(
                command, env=self.launcher_env(), capture_output=True, text=True, timeout=30
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SshHosts: {self.name(node)} did not answer over ssh within "
                    f"{START_SECONDS} s: {done.stderr.strip()} {self._log(node)}"
                )
            time.sleep(0.1)

    def _log(self, node):
        with open(self._path(f"sshd{node}.log")) as f:
            return f.read()[-2000:]
