"""A bound on how long a rank waits for one of the library's collectives, and what every
rank of its process set was doing when the bound ran out.

A rank that raised, died, hangs or took another path leaves the others waiting in a
collective it never submits. Horovod's stall inspector only warns (on the coordinator), and
its shutdown (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) did not end such a wait of a
TensorFlow step. So every wait of the PyTorch port (``exchange.wait``) is bounded
(``timeout``); when the bound runs out the rank raises ``CollectiveTimeout``, naming the
collective (``hvdc.<tensor>.<part>``) and the state of every rank of the process set:
waiting in the same collective, in another one, not in one of the library's (computing, or
gone elsewhere), or not answering (exited, killed or unreachable).

TensorFlow runs its collectives inside the step's graph, where Python cannot poll them: the
TensorFlow port marks where each step's exchange begins and ends, and a ``Monitor`` thread
whose bound runs out logs the same error and shuts Horovod down, which ends the step with
an error on every rank.

Those states come from a side channel, not from Horovod, whose collectives cannot reach a
rank that never arrives: every process answers, on a TCP port of its own, what it waits in
(``serve``); the ports' agreement gathers every rank's ``address`` at the first step, and
a rank whose bound ran out asks the others (``Peers.states``). The answer costs nothing per
step: the record (``WAITS``) is a few attributes set per wait, and the server thread sleeps
in ``accept`` until asked.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time

TIMEOUT_VARIABLE = "HVD_COMPRESS_TIMEOUT"
# Seconds: twice Horovod's stall warning (``HOROVOD_STALL_CHECK_TIME_SECONDS``, 60 s), so
# that its warning names the missing ranks on the coordinator first; long enough for ranks
# whose first step compiles (Triton, numba) at different speeds.
DEFAULT_TIMEOUT = 120.0
# Seconds a rank whose bound ran out gives each other rank to answer.
_ANSWER_SECONDS = 2.0


class CollectiveTimeout(RuntimeError):
    """A collective of the library did not complete within ``timeout()`` seconds."""


def timeout() -> float | None:
    """The bound on one wait, in seconds, from ``HVD_COMPRESS_TIMEOUT``
    (default ``DEFAULT_TIMEOUT``); None where it is 0: wait as long as Horovod does."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(
            f"{TIMEOUT_VARIABLE} must be a number of seconds >= 0 (0: no bound), got {text!r}"
        )
    return seconds or None


class Waits:
    """What this process waits in: the collective (its kind and name) and since when, or
    since when it waits in none. One per process: the port's waits run on the
    thread that steps."""

    def __init__(self):
        self.kind = self.name = None
        self.since = time.monotonic()
        # Whether the wait in ``name`` ended at its bound: the rank arrived at that
        # collective and raised, as the others waiting in it will.
        self.expired = False

    def enter(self, kind: str, name: str) -> None:
        self.kind, self.name, self.expired = kind, name, False
        self.since = time.monotonic()

    def leave(self, expired: bool = False) -> None:
        if not expired:
            self.kind = self.name = None
        self.expired = expired
        self.since = time.monotonic()

    def state(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "expired": self.expired,
            "seconds": time.monotonic() - self.since,
            "pid": os.getpid(),
        }


WAITS = Waits()
_server = None  # (address, thread) once ``serve`` started it
_server_lock = threading.Lock()


def address() -> dict:
    """Where this process answers what it waits in, as peers reach it; starts the answering
    thread on first use."""
    global _server
    with _server_lock:
        if _server is None:
            listener = socket.create_server(("", 0), backlog=64)
            token = secrets.token_hex(16)
            thread = threading.Thread(
                target=_answer, args=(listener, token), name="hvd_compress.watchdog", daemon=True
            )
            thread.start()
            host = socket.gethostname()
            _server = {
                "host": host,
                "hosts": _host_addresses(host),
                "port": listener.getsockname()[1],
                "token": token,
            }
        return _server


def _host_addresses(host):
    """The addresses other hosts may reach ``host`` by: Horovod's name for it, if the
    launcher set one, then its name and the addresses it resolves to."""
    names = [os.environ.get("HOROVOD_HOSTNAME"), host]
    with contextlib.suppress(OSError):
        names += [info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    return list(dict.fromkeys(n for n in names if n))


def _answer(listener, token):
    while True:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(_ANSWER_SECONDS)
            try:
                asked = connection.recv(64).decode(errors="replace").strip()
                if hmac.compare_digest(asked, token):
                    connection.sendall(json.dumps(WAITS.state()).encode())
            except OSError:
                pass


def _ask(peer):
    """``peer``'s ``Waits.state``, or None where no process answers at its address."""
    hosts = ["127.0.0.1"] if peer["host"] == socket.gethostname() else peer["hosts"]
    for host in hosts:
        try:
            with socket.create_connection((host, peer["port"]), timeout=_ANSWER_SECONDS) as s:
                s.sendall(peer["token"].encode() + b"\n")
                s.shutdown(socket.SHUT_WR)
                chunks = []
                while chunk := s.recv(4096):
                    chunks.append(chunk)
            return json.loads(b"".join(chunks))
        except (OSError, ValueError):
            continue
    return None


class Peers:
    """The addresses of the ranks of one process set (``address`` of each, in rank order)
    and this rank's place among them."""

    def __init__(self, addresses: list, rank: int):
        self.addresses, self.rank = addresses, rank

    def states(self) -> list:
        """Every rank's ``Waits.state`` (this rank's own without asking), None for a rank
        that does not answer."""
        return [
            WAITS.state() if rank == self.rank else _ask(peer)
            for rank, peer in enumerate(self.addresses)
        ]


def expired(kind: str, name: str, seconds: float, peers: Peers | None) -> CollectiveTimeout:
    """The ``CollectiveTimeout`` of this rank's wait in the collective ``name`` (the ports
    name one ``hvdc.<tensor or bucket>.<part>``) that ran out after ``seconds``, naming
    what every rank of ``peers`` does (unknown before the first agreement, which tells the
    ranks each other's addresses)."""
    lines = [
        f"hvd_compress: the {kind} {name!r} did not complete within {seconds:g} s "
        f"({TIMEOUT_VARIABLE}; 0 waits without a bound)."
    ]
    if peers is None:
        lines.append(
            "The ranks had not yet exchanged their states (this is the first collective "
            "of the step that checks their configurations): a rank has not reached its "
            "first step, has failed or has exited."
        )
    else:
        states = peers.states()
        absent = [r for r, s in enumerate(states) if s is None or s["name"] != name]
        lines.append(
            f"Ranks that did not arrive: {', '.join(map(str, absent)) or 'none'} "
            f"(of {len(states)}; rank {peers.rank} is this one)."
        )
        lines += [f"  rank {r}: {_describe(s)}" for r, s in enumerate(states)]
    return CollectiveTimeout("\n".join(lines))


def _describe(state):
    if state is None:
        return "no answer: exited, killed or unreachable"
    if state["expired"]:
        return f"gave up waiting in {state['kind']} {state['name']!r} at its bound"
    if state["name"] is None:
        return (
            f"in no collective of hvd_compress for {state['seconds']:.1f} s "
            f"(computing, stopped, or gone on without the others; pid {state['pid']})"
        )
    return f"waiting in {state['kind']} {state['name']!r} for {state['seconds']:.1f} s"


class Monitor:
    """A thread that ends a wait no poll can bound (a TensorFlow step's collectives): every
    ``period`` it looks at ``WAITS``, and once a wait has lasted ``timeout()`` seconds it
    logs ``expired``'s error with ``peers()`` and calls ``stop`` (the port shuts Horovod
    down, which fails the waiting collectives on every rank). ``error`` keeps that error."""

    def __init__(self, peers, stop, period: float = 0.5):
        self.peers, self.stop, self.period = peers, stop, period
        self.error = None
        threading.Thread(target=self._watch, name="hvd_compress.monitor", daemon=True).start()

    def _watch(self):
        while self.error is None:
            time.sleep(self.period)
            bound = timeout()
            kind, name, since = WAITS.kind, WAITS.name, WAITS.since
            if bound is None or name is None or WAITS.expired:
                continue
            if time.monotonic() - since > bound:
                WAITS.leave(expired=True)
                self.error = expired(kind, name, bound, self.peers())
                logging.getLogger("hvd_compress").error("%s", self.error)
                self.stop()
