"""Runs a command on the ranks of named hosts, all on this machine's loopback, with the
environment ``horovodrun -H`` gives them (Horovod's local and cross ranks, hostnames), so
that a job on one machine sees the nodes of a cluster:

    python -m tests.nodes node0:2,node1:2 TIMEOUT COMMAND...
"""

import sys

from benchmarks.job import HorovodJob, LocalHosts


def main(hosts, timeout, *command):
    workers = sum(int(host.split(":")[1]) for host in hosts.split(","))
    # Gloo's collectives wait as long as the job may run, as with horovodrun's
    # --gloo-timeout-seconds: a rank that compiles or traces longer is not a failure.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": timeout}
    return HorovodJob(LocalHosts(workers, hosts), command, env=env).run(float(timeout))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
