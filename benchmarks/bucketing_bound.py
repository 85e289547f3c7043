"""The most that bucketing gradient tensors together could save each rank: the gradients a
codec compresses on the synthetic ResNet-50, exchanged as its separate tensors or as one flat
tensor of the same elements, alternately in the same Horovod job.

    OMP_NUM_THREADS=1 horovodrun -np 4 -H localhost:4 --gloo \\
        python -m benchmarks.bucketing_bound [--codecs terngrad,qsgd-inf,ef-sign]

One flat tensor is the limit of bucketing (DDP's buckets, DeepSpeed's flat buffers): the same
per-element passes, with one tensor's operations and collectives instead of one set per
tensor. Its blocks and buckets are cut differently (ef-sign's single block covers everything),
which changes the values sent but not the work. Nothing is shaped: what is measured is each
rank's CPU time, which bounds the step when ranks outnumber cores (4 on 2 here). The loss is
a dot product with fixed coefficients, so the backward pass is one cheap pass per tensor.
"""

import argparse
import gc
import statistics
import time

import horovod.torch as hvd
import torch

import hvd_compress.pt as hc
from hvd_compress.registry import resolve

from .codec_profile import compressed_shapes
from .methods import sgd
from .models import SyntheticResNet50

LAYOUTS = ("tensors", "flat")


class Layout:
    """The codec's gradients as 1-D parameters (1-D, so that no tensor is taken for the
    classifier a second time), trained by ``hvd_compress.pt.DistributedOptimizer``."""

    def __init__(self, name, codec, sizes):
        self.params = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
        generator = torch.Generator().manual_seed(hvd.rank())
        self.coefficients = [torch.randn(size, generator=generator) for size in sizes]
        self.optimizer = hc.DistributedOptimizer(
            sgd(torch.nn.ParameterList(self.params), 0.01),
            [(f"{name}.{i}", p) for i, p in enumerate(self.params)],
            compression=codec,
        )

    def step(self):
        self.optimizer.zero_grad()
        sum((p * c).sum() for p, c in zip(self.params, self.coefficients)).backward()
        self.optimizer.step()


def measure(layout, steps):
    """Per step: (wall, process CPU, main-thread CPU) seconds."""
    times = []
    for _ in range(steps):
        wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
        layout.step()
        times.append(
            (time.perf_counter() - wall, time.process_time() - process, time.thread_time() - thread)
        )
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,ef-sign")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of both layouts, alternated against drifts of the load",
    )
    args = parser.parse_args(argv)
    hvd.init()
    named = list(SyntheticResNet50().named_parameters())
    rows = [
        "| codec | layout | tensors | step (ms) | process CPU (ms) | main thread CPU (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.codecs.split(","):
        sizes = [shape.numel() for shape in compressed_shapes(resolve(name, hc.CODECS), named)]
        layouts = {
            "tensors": Layout(f"{name}.tensors", name, sizes),
            "flat": Layout(f"{name}.flat", name, [sum(sizes)]),
        }
        times = {key: [] for key in LAYOUTS}
        for _ in range(args.rounds):
            for key in LAYOUTS:
                measure(layouts[key], 2)  # warm-up: allocations, Horovod's response cache
                times[key] += measure(layouts[key], args.steps)
        # Medians per rank, then the median rank: every rank does the same work.
        per_rank = hvd.allgather_object(
            {
                key: [statistics.median(t[i] for t in times[key]) for i in range(3)]
                for key in LAYOUTS
            }
        )
        for key in LAYOUTS:
            medians = [statistics.median(rank[key][i] for rank in per_rank) for i in range(3)]
            rows.append(
                f"| {name} | {key} | {len(layouts[key].params)} | "
                + " | ".join(f"{1000 * m:.0f}" for m in medians)
                + " |"
            )
        del layouts
        gc.collect()
    if hvd.rank() == 0:
        print(
            f"{hvd.size()} ranks, medians over {args.rounds} x {args.steps} steps and over "
            f"the ranks:\n" + "\n".join(rows),
            flush=True,
        )


if __name__ == "__main__":
    main()
