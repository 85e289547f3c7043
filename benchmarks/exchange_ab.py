"""One codec's training step under two exchanges, side by side in one Horovod job: the
synthetic ResNet-50 (or the MNIST-1D CNN) trained by ``hvd_compress.pt.DistributedOptimizer``
with each ``exchange=``, in alternating blocks of steps, so that a drift of the load falls on
both.

    launch/netns.sh -n 2 -r 1G -- python -m benchmarks.exchange_ab \\
        [--codec ef-sign] [--exchanges allgather,auto] [--model resnet50]

Run it on the benchmark's shaped network (``launch/netns.sh``) or on localhost under
``horovodrun``; rank 0 prints each exchange's median step and what ``"auto"`` chose.
"""

import argparse
import collections
import statistics
import time

import horovod.torch as hvd
import torch

from .methods import CodecTrainer
from .models import workload

# Untimed steps of each exchange before the first block: allocations, the kernels' compilation.
WARMUP_STEPS = 3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="ef-sign")
    parser.add_argument("--exchanges", default="allgather,auto")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "cnn"))
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each exchange")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block")
    args = parser.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    work = workload(args.model, hvd.rank(), hvd.size())
    batches = work.batches(1)
    trainers = {
        exchange: CodecTrainer(work.build(), hvd.size(), 0.01, args.codec, exchange=exchange)
        for exchange in args.exchanges.split(",")
    }
    for trainer in trainers.values():
        for _ in range(WARMUP_STEPS):
            trainer.step(*next(batches))
    seconds = {exchange: [] for exchange in trainers}
    for block in range(args.rounds):
        # Each round in the other order: neither exchange always follows the other.
        order = list(trainers) if block % 2 == 0 else list(reversed(trainers))
        for exchange in order:
            hvd.allreduce(torch.zeros(1), name=f"exchange_ab.{block}.{exchange}")
            for _ in range(args.steps):
                start = time.perf_counter()
                trainers[exchange].step(*next(batches))
                seconds[exchange].append(time.perf_counter() - start)
    if hvd.rank() == 0:
        print(f"{args.codec}, {args.model}, N = {hvd.size()}:")
        print("| exchange | tensors by exchange | median step (ms) |")
        print("|---|---|---|")
        for exchange, trainer in trainers.items():
            routes = collections.Counter(
                route for _, _, route, _ in trainer.optimizer.compression_stats()["tensors"]
            )
            chosen = ", ".join(f"{route} {count}" for route, count in sorted(routes.items()))
            print(f"| {exchange} | {chosen} | {1000 * statistics.median(seconds[exchange]):.0f} |")


if __name__ == "__main__":
    main()
