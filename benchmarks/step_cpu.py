"""Where a worker's CPU goes in a training step of the PyTorch port.

With more ranks than cores (4 on 2 in this project's benchmarks) a step is bounded by the
CPU the ranks need, not only by the network: a codec's every millisecond of CPU costs about
N / cores milliseconds of step. This splits one rank's step into what the bandwidth cannot
explain, for one codec (or ``none``, Horovod's allreduce through the pipeline) against the
same step with no exchange at all:

- ``main CPU``: the training thread's CPU time (``time.thread_time``), of which
  ``kernels`` is the time inside ``hvd_compress.kernels`` (the fused codec passes) and
  ``compute`` the step with no exchange (forward, backward, SGD); the ``rest`` is the
  pipeline's Python and torch calls around them, per tensor, and the polls of its waits;
- ``other threads``: the process's CPU time beyond the training thread's (Horovod's
  background thread, Gloo's);
- ``rest per tensor``: the ``rest`` over the model's parameter tensors, in microseconds:
  what the pipeline costs per tensor, which decides the CPU of models of many small tensors
  (``--model layers``: 600 of 10K elements);
- ``blocked``: wall time in ``hvd_compress.pt.exchange.wait`` (the network, the other
  ranks), as ``collectives.HorovodProbe`` adds it up for the benchmark.

Run it on the benchmark's shaped network or on localhost; each rank reports, rank 0 prints
the mean over ranks as a Markdown table:

    launch/netns.sh -n 4 -r 100M -- python -m benchmarks.step_cpu --codecs ef-sign,terngrad
"""

import argparse
import statistics
import time

import horovod.torch as hvd
import torch

import hvd_compress.pt as hc
from hvd_compress import fused

from .collectives import HorovodProbe
from .methods import Trainer, sgd
from .models import flush_subnormals, workload

# Untimed steps first: the heap grows for three steps (``methods.Trainer.warmup_steps``),
# and the kernels compile.
WARMUP_STEPS = 4
COLUMNS = (
    "wall",
    "main CPU",
    "compute",
    "kernels",
    "rest",
    "rest per tensor",
    "other threads",
    "blocked",
)


class _KernelClock:
    """Thread CPU seconds spent in ``hvd_compress.kernels``, summed while installed (the
    module is reached through ``fused.kernels()``)."""

    def __init__(self):
        self.seconds = 0.0
        self._original = fused.kernels

    def __enter__(self):
        kernels, clock = self._original(), self

        class Timed:
            def __getattr__(self, name):
                function = getattr(kernels, name)
                if not callable(function):  # the kernels' constants
                    return function

                def timed(*args):
                    start = time.thread_time()
                    try:
                        return function(*args)
                    finally:
                        clock.seconds += time.thread_time() - start

                return timed

        timed_kernels = Timed()
        fused.kernels = lambda: timed_kernels
        return self

    def __exit__(self, *exc):
        fused.kernels = self._original


def timed_steps(trainer, batches, steps, clocks=None):
    """(wall, main-thread CPU, process CPU) seconds per step over ``steps`` steps, after
    the warm-up, started together on every rank; ``clocks`` (a ``_KernelClock`` and a
    ``collectives.HorovodProbe``) count from there."""
    for _ in range(WARMUP_STEPS):
        trainer.step(*next(batches))
    hvd.allreduce(torch.zeros(1), name="hvdc.step_cpu.barrier")
    if clocks is not None:
        kernels, probe = clocks
        kernels.seconds = probe.wait_seconds = 0.0
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        trainer.step(*next(batches))
    return (
        (time.perf_counter() - wall) / steps,
        (time.thread_time() - thread) / steps,
        (time.process_time() - process) / steps,
    )


def measure(model_name, codec, steps):
    """This rank's {column: milliseconds per step (rest per tensor: microseconds)} for
    ``codec``."""
    work = workload(model_name, hvd.rank(), hvd.size())
    model = work.build()
    _, compute, _ = timed_steps(
        Trainer(model, sgd(model, 0.01), hvd.size()), work.batches(1), steps
    )
    model = work.build()
    optimizer = hc.DistributedOptimizer(
        sgd(model, 0.01), model.named_parameters(), compression=codec
    )
    with _KernelClock() as clock, HorovodProbe() as probe:
        wall, main, process = timed_steps(
            Trainer(model, optimizer, hvd.size()), work.batches(2), steps, (clock, probe)
        )
    kernels, blocked = clock.seconds / steps, probe.wait_seconds / steps
    seconds = {
        "wall": wall,
        "main CPU": main,
        "compute": compute,
        "kernels": kernels,
        "rest": main - compute - kernels,
        "other threads": process - main,
        "blocked": blocked,
    }
    milliseconds = {column: 1000 * value for column, value in seconds.items()}
    milliseconds["rest per tensor"] = 1000 * milliseconds["rest"] / len(list(model.parameters()))
    return milliseconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="ef-sign,terngrad,qsgd-inf,none")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "cnn", "layers"))
    parser.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    args = parser.parse_args(argv)
    hvd.init()
    flush_subnormals()
    rows = []
    for codec in args.codecs.split(","):
        measured = hvd.allgather_object(measure(args.model, codec, args.steps))
        rows.append((codec, {c: statistics.mean(m[c] for m in measured) for c in COLUMNS}))
    if hvd.rank() == 0:
        print(
            f"{args.model}, N = {hvd.size()}, ms per step, mean over ranks "
            f"(kernels are thread CPU time, blocked is wall time; rest per tensor in us):"
        )
        print("| codec | " + " | ".join(COLUMNS) + " |")
        print("|---" * (len(COLUMNS) + 1) + "|")
        for codec, row in rows:
            print(f"| {codec} | " + " | ".join(f"{row[c]:.0f}" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
