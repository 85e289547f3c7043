"""Horovod's Gloo rendezvous server as a process of its own, so that it can run inside the
test network's switch namespace.

    python -m benchmarks.rendezvous host0:1,host1:1 2

prints the port it listens on, then serves until its standard input is closed.
"""

import sys

from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer


def main(hosts, workers):
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), int(workers)))
    print(port, flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
