"""How fast Horovod's collectives over Gloo carry one message per rank, by its size, against
the same bytes over a plain TCP connection between two ranks: what the cost model's fixed
latency and link rate leave out.

Each row is one collective of a single tensor, so that Horovod fuses nothing into it, and
each sends (N - 1) B bytes per rank: an allgather of B bytes per rank, an alltoall that sends
B bytes to each other rank, and an allreduce whose ring does (a float32 tensor of N B / 8
elements). The TCP rows (two ranks only) send B bytes from rank 0 to rank 1 ("one way") and
B bytes each way at once on one connection ("both ways"), as an allgather or alltoall of two
ranks does. On the benchmark's shaped network:

    launch/netns.sh -n 2 -r 100M -- .venv/bin/python -m benchmarks.message_sizes

Rank 0 prints the median wall milliseconds of ``--repeats`` rounds, each begun at a barrier,
beside the time the bytes take at ``--rate``.
"""

import argparse
import socket
import statistics
import threading
import time

import horovod.torch as hvd
import torch

from .network import parse_rate

SIZES_MB = (0.4, 1.6, 6.4, 25.6)
PORT = 29517


def _timed(run, repeats):
    """Median wall seconds of ``run(round)`` over ``repeats`` rounds begun together."""
    seconds = []
    for round_ in range(repeats):
        hvd.barrier()
        start = time.perf_counter()
        run(round_)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _collectives(nbytes, world_size):
    """{row: run(round)} of the Horovod collectives that each send (N - 1) ``nbytes`` per
    rank (the module's docstring says how)."""
    per_peer = torch.ones(nbytes * world_size, dtype=torch.uint8)
    own = torch.ones(nbytes, dtype=torch.uint8)
    ring = torch.ones(nbytes * world_size // 8)
    return {
        "allgather": lambda r: hvd.allgather(own, name=f"hvdc.sizes.ag.{nbytes}.{r}"),
        "alltoall": lambda r: hvd.alltoall(per_peer, name=f"hvdc.sizes.a2a.{nbytes}.{r}"),
        "allreduce": lambda r: hvd.allreduce(ring, name=f"hvdc.sizes.ar.{nbytes}.{r}"),
    }


def _receive(connection, nbytes):
    buffer, received = bytearray(1 << 20), 0
    while received < nbytes:
        received += connection.recv_into(buffer, min(len(buffer), nbytes - received))


def _tcp_connection():
    """A TCP connection between ranks 0 and 1 (rank 0 listens on its host's address)."""
    address = hvd.broadcast_object(socket.gethostbyname(socket.gethostname()), root_rank=0)
    if hvd.rank() == 0:
        with socket.create_server((address, PORT)) as server:
            hvd.barrier()
            connection, _ = server.accept()
    else:
        hvd.barrier()
        connection = socket.create_connection((address, PORT))
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _tcp(connection, nbytes):
    """{row: run(round)} of the TCP transfers of ``nbytes`` (ranks 0 and 1)."""
    data = bytes(nbytes)

    def one_way(_):
        if hvd.rank() == 0:
            connection.sendall(data)
            _receive(connection, 1)  # rank 1 has all of it
        else:
            _receive(connection, nbytes)
            connection.sendall(b"\0")

    def both_ways(_):
        sender = threading.Thread(target=connection.sendall, args=(data,))
        sender.start()
        _receive(connection, nbytes)
        sender.join()

    return {"TCP one way": one_way, "TCP both ways": both_ways}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100M", help="the link rate the bytes are set against")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    hvd.init()
    connection = _tcp_connection() if hvd.size() == 2 else None
    rows = []
    for megabytes in SIZES_MB:
        nbytes = int(megabytes * 1e6)
        runs = _collectives(nbytes, hvd.size())
        if connection is not None:
            runs.update(_tcp(connection, nbytes))
        seconds = {label: _timed(run, args.repeats) for label, run in runs.items()}
        rows.append((megabytes, (hvd.size() - 1) * nbytes * 8 / parse_rate(args.rate), seconds))
    if hvd.rank() == 0:
        labels = list(rows[0][2])
        print(f"N = {hvd.size()}, wall ms (fraction of the link rate {args.rate}):")
        print("| B (MB) | (N - 1) B at the link rate | " + " | ".join(labels) + " |")
        print("|---" * (2 + len(labels)) + "|")
        for megabytes, wire, seconds in rows:
            cells = [f"{s * 1e3:,.0f} ({wire / s:.0%})" for s in seconds.values()]
            print(f"| {megabytes} | {wire * 1e3:,.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
