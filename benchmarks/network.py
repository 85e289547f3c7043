"""A bandwidth-limited test network on one machine: one Linux network namespace per node,
joined to a bridge by veth pairs whose both directions are rate-limited with ``tc tbf``.

    with TestNetwork(4) as network:      # needs root (CAP_NET_ADMIN)
        network.shape("100mbit")
        ...start worker k with network.exec_prefix(k) on network.address(network.node(k))...

A node holds one worker, or ``per_node`` = L of them: M = N / L nodes of a cluster whose
workers inside a node talk over the namespace's loopback, unshaped (the fast tier: NVLink,
shared memory), and between nodes over the shaped links (the network).

Layout (benchmarks/README.md, "The test network", describes its use): the
namespace ``<prefix>sw`` is the switch, holding the bridge ``br0`` at ``SWITCH_ADDRESS``;
node k lives in ``<prefix>w<k>`` with its end of the link named ``eth0`` at
``10.231.0.<k+1>``; its workers are ranks k L .. (k + 1) L - 1, as Horovod places ranks on
hosts in order. Nothing is created in the caller's namespace, so no traffic leaves
these namespaces. Everything is removed on exit, on an exception and on SIGTERM/SIGINT/SIGHUP
(turned into ``SystemExit`` so that ``with`` blocks unwind); ``teardown(prefix)`` also clears
what a killed run left behind.
"""

import argparse
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys

from .job import HorovodJob, NamespacedHosts

PREFIX = "hvdcb-"
SUBNET = "10.231.0"
SWITCH_ADDRESS = f"{SUBNET}.254"
WORKER_INTERFACE = "eth0"
MAX_NODES = 200  # addresses .1 to .200 of SUBNET

# tbf's bucket must hold at least one timer tick of traffic or the rate is not reached:
# 256 KB held 100 Mbit/s to 95.5 Mbit/s on this harness's links; faster rates get 2 ms.
MIN_BURST_BYTES = 256 * 1024
BURST_SECONDS = 0.002
# Packets may wait this long in the bucket's queue before tbf drops them.
QUEUE_LATENCY = "100ms"

RATE_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text):
    """Bits per second of a rate such as ``100M``, ``1G``, ``10gbit`` or ``2.5e8``."""
    lowered = str(text).strip().lower().removesuffix("bit").removesuffix("bps")
    scale = RATE_UNITS.get(lowered[-1:], 1.0)
    number = lowered[:-1] if lowered[-1:] in RATE_UNITS else lowered
    try:
        bits = float(number) * scale
    except ValueError:
        bits = float("nan")
    if not bits > 0:
        raise ValueError(
            f"rate must be a positive number of bits per second such as 100M, "
            f"1G or 10G; got {text!r}"
        )
    return bits


def format_rate(bits):
    """``100M``, ``1G``, ``10G``: the shortest name of a rate."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}"


def _run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def _ip(*args, namespace=None):
    _run(["ip"] + (["-n", namespace] if namespace else []) + list(args))


def _tc(namespace, *args):
    _run(["tc", "-n", namespace] + list(args))


def check_topology(workers, per_node):
    """Raises ValueError unless N = ``workers`` fills nodes of L = ``per_node`` workers."""
    if not isinstance(workers, int) or not workers >= 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if not isinstance(per_node, int) or per_node < 1 or workers % per_node:
        raise ValueError(
            f"per_node must be a positive divisor of the {workers} workers, got {per_node!r}"
        )
    if workers // per_node > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes, got {workers} / {per_node}")


def unavailable_reason():
    """Why this process cannot build a TestNetwork, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); this process is not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetworkInUse(RuntimeError):
    pass


def _lock(prefix):
    """Holds the lock that says a live network uses ``prefix`` (released when the file is
    closed or the process dies), so that a second run never tears down the first one's."""
    lock = open(f"/run/{prefix}netns.lock", "w")  # noqa: SIM115 (held open: the lock)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise NetworkInUse(
            f"another test network with the prefix {prefix!r} is running; wait for it to finish"
        ) from None
    return lock


def teardown(prefix=PREFIX):
    """Removes every namespace and hosts file whose name starts with ``prefix``, left by a
    run that is gone; raises ``NetworkInUse`` if a live run holds them."""
    with _lock(prefix):
        _remove(prefix)


def _remove(prefix):
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if os.path.isdir("/etc/netns"):
        for name in os.listdir("/etc/netns"):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
        if not os.listdir("/etc/netns"):
            os.rmdir("/etc/netns")  # created for us; kept if anything else uses it


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


class TestNetwork:
    """N workers in M = N / L node namespaces on one bridge, each node's link shaped in both
    directions.

    Args:
        workers (int): number of workers, N.
        per_node (int): workers per node namespace, L (a divisor of N).
        prefix (str): names of the namespaces and hosts files; a teardown removes only
            names with this prefix.
    """

    def __init__(self, workers, per_node=1, prefix=PREFIX):
        check_topology(workers, per_node)
        reason = unavailable_reason()
        if reason is not None:
            raise PermissionError(f"TestNetwork: {reason}")
        self.workers, self.per_node, self.prefix = workers, per_node, prefix
        self.nodes = workers // per_node
        self.switch = f"{prefix}sw"
        self.switch_address = SWITCH_ADDRESS
        self.rate = None
        self._previous_handlers = {}
        self._lock = None

    def node(self, rank):
        """The node that holds worker ``rank``."""
        return rank // self.per_node

    def namespace(self, node):
        return f"{self.prefix}w{node}"

    def address(self, node):
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, rank):
        """The command prefix that runs a program inside worker ``rank``'s node namespace."""
        return ["ip", "netns", "exec", self.namespace(self.node(rank))]

    def pids(self, node):
        """The processes running in ``node``'s namespace."""
        listing = subprocess.run(
            ["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in listing.split()]

    def switch_exec_prefix(self):
        return ["ip", "netns", "exec", self.switch]

    def __enter__(self):
        self._lock = _lock(self.prefix)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous_handlers[signum] = signal.signal(signum, _exit_on_signal)
        try:
            _remove(self.prefix)  # what a killed run may have left
            self._build()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc):
        _remove(self.prefix)
        self._lock.close()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _build(self):
        _ip("netns", "add", self.switch)
        _ip("link", "set", "lo", "up", namespace=self.switch)
        _ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
        _ip("addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0", namespace=self.switch)
        _ip("link", "set", "br0", "up", namespace=self.switch)
        # Gloo resolves this machine's host name for the global process set's context
        # (Horovod 0.28.1 ignores HOROVOD_GLOO_IFACE there); `ip netns exec` mounts
        # /etc/netns/<ns>/hosts over /etc/hosts, so map the name to the worker's address.
        hostname = socket.gethostname()
        for node in range(self.nodes):
            namespace = self.namespace(node)
            _ip("netns", "add", namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)
            _ip(
                "link",
                "add",
                self._port(node),
                "type",
                "veth",
                "peer",
                "name",
                WORKER_INTERFACE,
                "netns",
                namespace,
                namespace=self.switch,
            )
            _ip("link", "set", self._port(node), "master", "br0", "up", namespace=self.switch)
            _ip(
                "addr",
                "add",
                f"{self.address(node)}/24",
                "dev",
                WORKER_INTERFACE,
                namespace=namespace,
            )
            _ip("link", "set", WORKER_INTERFACE, "up", namespace=namespace)
            os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
            with open(f"/etc/netns/{namespace}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(node)} {hostname}\n")

    def _port(self, node):
        """The bridge's end of ``node``'s link."""
        return f"p{node}"

    def shape(self, rate):
        """Limits every node's link to ``rate`` (``"100M"``, ``"1G"``, bits per second) in
        both directions: the node's uplink (its ``eth0``) and its downlink (the bridge port)."""
        bits = parse_rate(rate)
        burst = max(MIN_BURST_BYTES, int(bits / 8 * BURST_SECONDS))
        tbf = [
            "root",
            "tbf",
            "rate",
            f"{int(bits)}bit",
            "burst",
            str(burst),
            "latency",
            QUEUE_LATENCY,
        ]
        for node in range(self.nodes):
            _tc(self.namespace(node), "qdisc", "replace", "dev", WORKER_INTERFACE, *tbf)
            _tc(self.switch, "qdisc", "replace", "dev", self._port(node), *tbf)
        self.rate = bits


def main(argv=None):
    """``launch/netns.sh``: runs a command as a Horovod job, one worker per namespace."""
    parser = argparse.ArgumentParser(
        prog="launch/netns.sh",
        description="Run a Horovod job over Gloo with one worker (or --per-node L) per "
        "network namespace, every namespace's link shaped with tc tbf; everything is torn "
        "down on exit.",
    )
    parser.add_argument("-n", "--workers", type=int, default=2, help="N (default 2)")
    parser.add_argument(
        "--per-node",
        type=int,
        default=1,
        help="workers per node namespace, L (default 1); inside a node they talk unshaped",
    )
    parser.add_argument(
        "-r", "--rate", default="100M", help="link rate in bits/s, both directions (default 100M)"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds (default 3600)")
    parser.add_argument(
        "--teardown",
        action="store_true",
        help=f"only remove namespaces left by a killed run ({PREFIX}*)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    args = parser.parse_args(argv)
    if args.teardown:
        try:
            teardown()
        except NetworkInUse as error:
            sys.exit(f"netns: not tearing down: {error}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    parse_rate(args.rate)
    try:
        check_topology(args.workers, args.per_node)
    except ValueError as error:
        parser.error(str(error))
    try:
        with TestNetwork(args.workers, args.per_node) as network:
            network.shape(args.rate)
            print(
                f"netns: {args.workers} workers, {args.per_node} per node, at "
                f"{format_rate(network.rate)}bit/s per node link "
                f"({', '.join(network.address(k) for k in range(network.nodes))})",
                flush=True,
            )
            return HorovodJob(NamespacedHosts(network), command).run(args.timeout)
    except (PermissionError, NetworkInUse) as error:
        sys.exit(str(error))


if __name__ == "__main__":
    sys.exit(main())
