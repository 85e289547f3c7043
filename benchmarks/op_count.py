"""Top-level torch ops of one training step per codec: what compression adds per tensor.

On a GPU every tensor op is at least one kernel launch (5-10 us each), so a codec that
issues dozens of ops per gradient tensor costs milliseconds a step before it moves a byte.
This counts, with ``torch.profiler`` on CPU, the ``aten::`` ops of one whole step (forward,
backward, exchange, optimizer) that no other ``aten::`` op encloses, for one of the
benchmark's models (the synthetic ResNet-50 by default), and reports each codec's count
minus that of the same step with ``none``, divided by the model's tensors and by the tensors
the codec compresses. The counts do not depend on the link, so the job runs on localhost:

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.op_count [--codecs ...] \
        [--model resnet50]

Rank 0 prints a Markdown table (and with ``--out``, writes it as JSON).
"""

import argparse
import json

import horovod.torch as hvd
import torch
from torch.profiler import ProfilerActivity, profile

import hvd_compress.pt as hc

from .models import workload
from .shapes import MODELS

# Steps before the profiled one: allocations and the compilation of the kernels.
WARMUP_STEPS = 5


def top_level_aten_ops(events):
    """The ``aten::`` events that have no ``aten::`` event among their ancestors."""
    count = 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def count(model_name, codec):
    """Top-level aten ops of one step, the model's tensors and those compressed."""
    work = workload(model_name, hvd.rank(), hvd.size())
    model = work.build()
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        model.named_parameters(),
        compression=codec,
    )
    inputs, targets = next(work.batches(0))

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(WARMUP_STEPS):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    tensors = optimizer.compression_stats()["tensors"]
    compressed = sum(1 for _, _, route, _ in tensors if not route.startswith("allreduce ("))
    return top_level_aten_ops(profiler.events()), len(tensors), compressed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,nuqsgd,ef-sign")
    parser.add_argument("--model", default="resnet50", choices=MODELS)
    parser.add_argument("--out", help="also write the counts as JSON here (rank 0)")
    args = parser.parse_args(argv)
    hvd.init()
    baseline, _, _ = count(args.model, "none")
    rows = []
    for name in args.codecs.split(","):
        ops, tensors, compressed = count(args.model, name)
        rows.append(
            {
                "codec": name,
                "ops": ops,
                "added": ops - baseline,
                "tensors": tensors,
                "compressed_tensors": compressed,
                "added_per_tensor": (ops - baseline) / tensors,
                "added_per_compressed_tensor": (ops - baseline) / compressed
                if compressed
                else None,
            }
        )
    if hvd.rank() == 0:
        print(
            f"Top-level aten ops of one step, {args.model}, N = {hvd.size()} (none: {baseline}):\n"
        )
        print(
            "| codec | ops | added | added per tensor | compressed tensors | "
            "added per compressed tensor |\n|---|---|---|---|---|---|"
        )
        for r in rows:
            per = r["added_per_compressed_tensor"]
            print(
                f"| {r['codec']} | {r['ops']:,} | {r['added']:,} | "
                f"{r['added_per_tensor']:.1f} (of {r['tensors']}) | "
                f"{r['compressed_tensors']} | {'-' if per is None else f'{per:.1f}'} |"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "model": args.model,
                        "world_size": hvd.size(),
                        "none": baseline,
                        "codecs": rows,
                    },
                    f,
                    indent=1,
                )


if __name__ == "__main__":
    main()
