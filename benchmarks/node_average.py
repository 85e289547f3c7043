"""What a node's average of the synthetic ResNet-50's gradient costs the two-level exchange,
by each collective that can take it: Horovod's reduce-scatter (each rank receives its shard
of the node's average) against an allreduce of the whole tensor (each rank keeps its
shard), each followed by the node's allgather of the shards, as the exchange runs them
around its compressed part (``hvd_compress.topology.averages_by_allreduce``).

Every node averages its own ranks' tensors at once, as in a step. On one machine, hosts that
all resolve to it make the nodes (here 2 of 2 ranks):

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python -m benchmarks.node_average
    mpirun -np 2 python -m benchmarks.node_average       # one node, MPI's collectives

Rank 0 prints the least wall time of each over ``--repeats`` rounds, the two timed in turn.
"""

import argparse
import time

import horovod.torch as hvd
import torch

from hvd_compress.pt import topology

from .models import SyntheticResNet50


def _both_ways(vector, node_set, local_size, shard):
    """The node's average and allgather of ``vector`` by reduce-scatter and by allreduce."""

    def by_reduce_scatter(name):
        mine = hvd.reducescatter(vector, name=f"{name}.rs", op=hvd.Average, process_set=node_set)
        return hvd.allgather(mine, name=f"{name}.ag", process_set=node_set)

    def by_allreduce(name):
        average = hvd.allreduce(vector, name=f"{name}.ar", op=hvd.Average, process_set=node_set)
        mine = average.view(local_size, -1)[shard]
        return hvd.allgather(mine, name=f"{name}.ag", process_set=node_set)

    return {"reduce-scatter + allgather": by_reduce_scatter, "allreduce + allgather": by_allreduce}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    hvd.init(process_sets="dynamic")
    nodes = topology.current_nodes()
    node_set, _ = topology.join(nodes)
    if node_set is None:
        raise SystemExit("node_average: every node holds one rank; nothing to average in one")
    _, shard = nodes.locate(hvd.rank())
    numel = sum(p.numel() for p in SyntheticResNet50().parameters())
    length = nodes.shard_length(numel)
    vector = torch.randn(nodes.local_size * length, generator=torch.Generator().manual_seed(0))
    ways = _both_ways(vector, node_set, nodes.local_size, shard)
    best = dict.fromkeys(ways, float("inf"))
    for round_ in range(args.repeats + 1):  # the first round allocates Horovod's buffers
        for label, way in ways.items():
            hvd.barrier()
            start = time.perf_counter()
            way(f"{label}.{round_}")
            if round_:
                best[label] = min(best[label], time.perf_counter() - start)
    if hvd.rank() == 0:
        print(
            f"The synthetic ResNet-50's {numel:,} float32 elements; nodes x ranks: "
            f"{nodes.cross_size} x {nodes.local_size}; {'Gloo' if hvd.gloo_enabled() else 'MPI'}"
        )
        print("| node's average and allgather | ms |\n|---|---|")
        for label, seconds in best.items():
            print(f"| {label} | {seconds * 1e3:,.0f} |")


if __name__ == "__main__":
    main()
