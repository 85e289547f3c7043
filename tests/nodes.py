"""Runs a command on the ranks of named hosts, all on this machine's loopback, with the
environment ``horovodrun -H`` gives them (Horovod's local and cross ranks, hostnames), so
that a job on one machine sees the nodes of a cluster:

    python -m tests.nodes node0:2,node1:2 TIMEOUT COMMAND...
    python -m tests.nodes --fork ZYGOTES node0:2,node1:2 TIMEOUT python -m MODULE ARGS...

With ``--fork``, rank r is forked by the zygote of slot r in the directory ZYGOTES
(``tests.zygote``) instead of started as a new interpreter. With ``--keep-going`` (first),
the other ranks run on when one fails, instead of being killed as ``horovodrun`` kills them.
"""

import sys

from benchmarks.job import REPO, HorovodJob, LocalHosts

from . import zygote


class ForkedJob(HorovodJob):
    """A ``HorovodJob`` whose ranks the zygotes of ``directory`` fork."""

    def __init__(self, directory, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.directory = directory
        if self.command[1:2] != ["-m"]:
            raise ValueError(f"a forked rank runs 'python -m MODULE ...', not {self.command}")

    def _spawn(self, rank, env):
        path = zygote.socket_path(self.directory, rank)
        return zygote.fork(path, self.command[2:], env, REPO)


def main(*argv):
    zygotes = None
    keep_going = argv[0] == "--keep-going"
    argv = argv[keep_going:]
    if argv[0] == "--fork":
        zygotes, argv = argv[1], argv[2:]
    hosts, timeout, *command = argv
    workers = sum(int(host.split(":")[1]) for host in hosts.split(","))
    # Gloo's collectives wait as long as the job may run, as with horovodrun's
    # --gloo-timeout-seconds: a rank that compiles or traces longer is not a failure.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": timeout}
    hosts = LocalHosts(workers, hosts)
    if zygotes is None:
        job = HorovodJob(hosts, command, env=env)
    else:
        job = ForkedJob(zygotes, hosts, command, env=env)
    return job.run(float(timeout), stop_at_failure=not keep_going)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
