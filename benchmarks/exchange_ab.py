"""One codec's training step under two exchanges, side by side in one Horovod job: the
synthetic ResNet-50 (or the MNIST-1D CNN) trained with each ``exchange=`` by
``hvd_compress.pt.DistributedOptimizer`` (or, with ``--tensorflow``, the TensorFlow port's
``DistributedGradientTape`` in a ``tf.function``), in alternating blocks of steps, so that
a drift of the load falls on both.

    launch/netns.sh -n 2 -r 1G -- python -m benchmarks.exchange_ab \\
        [--codec ef-sign] [--exchanges allgather,auto] [--model resnet50] [--tensorflow]

Run it on the benchmark's shaped network (``launch/netns.sh``) or on localhost under
``horovodrun``; rank 0 prints each exchange's median step and what ``"auto"`` chose.
"""

import argparse
import collections
import statistics

from .protocol import timed_steps

# Untimed steps of each exchange before the first block: allocations, the kernels'
# compilation, TensorFlow's trace.
WARMUP_STEPS = 3


def _torch_job(args):
    """(hvd, batches, {exchange: (trainer, stats)}, barrier) of the PyTorch port."""
    import horovod.torch as hvd
    import torch

    from .methods import CodecTrainer
    from .models import workload

    hvd.init()
    torch.set_num_threads(1)
    work = workload(args.model, hvd.rank(), hvd.size())
    batches = work.batches(1)
    runs = {}
    for exchange in args.exchanges.split(","):
        trainer = CodecTrainer(work.build(), hvd.size(), 0.01, args.codec, exchange=exchange)
        runs[exchange] = (trainer, trainer.optimizer.compression_stats)
    return hvd, batches, runs, lambda name: hvd.allreduce(torch.zeros(1), name=name)


def _tensorflow_job(args):
    """(hvd, batches, {exchange: (trainer, stats)}, barrier) of the TensorFlow port."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from .tf_worker import Workload, codec_trainer

    hvd.init()
    work = Workload(args.model, hvd.rank(), hvd.size(), seed=0)
    batches = work.batches(1)
    runs = {}
    for exchange in args.exchanges.split(","):
        trainer = codec_trainer(work, args.codec, hvd.size(), exchange)
        # The tape is the one of the step's trace: read once the step has run.
        runs[exchange] = (
            trainer,
            lambda trainer=trainer: trainer.tape.pipeline.compression_stats(),
        )
    return hvd, batches, runs, lambda name: hvd.allreduce(tf.zeros(1), name=name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="ef-sign")
    parser.add_argument("--exchanges", default="allgather,auto")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "cnn"))
    parser.add_argument("--tensorflow", action="store_true", help="the TensorFlow port")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each exchange")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block")
    args = parser.parse_args(argv)
    # One framework per process: each port refuses a process that imported both Horovods.
    hvd, batches, runs, barrier = (_tensorflow_job if args.tensorflow else _torch_job)(args)
    for trainer, _ in runs.values():
        timed_steps(trainer, batches, WARMUP_STEPS)
    seconds = {exchange: [] for exchange in runs}
    for block in range(args.rounds):
        # Each round in the other order: neither exchange always follows the other.
        order = list(runs) if block % 2 == 0 else list(reversed(runs))
        for exchange in order:
            barrier(f"exchange_ab.{block}.{exchange}")
            seconds[exchange] += timed_steps(runs[exchange][0], batches, args.steps)
    if hvd.rank() == 0:
        port = "TensorFlow" if args.tensorflow else "PyTorch"
        print(f"{args.codec}, {args.model}, {port}, N = {hvd.size()}:")
        print("| exchange | tensors by exchange | median step (ms) |")
        print("|---|---|---|")
        for exchange, (_, stats) in runs.items():
            routes = collections.Counter(route for _, _, route, _ in stats()["tensors"])
            chosen = ", ".join(f"{route} {count}" for route, count in sorted(routes.items()))
            print(f"| {exchange} | {chosen} | {1000 * statistics.median(seconds[exchange]):.0f} |")


if __name__ == "__main__":
    main()
