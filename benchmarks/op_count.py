"""Top-level torch ops of one training step per codec: what compression adds per tensor.

On a GPU every tensor op is at least one kernel launch (5-10 us each), so a codec that
issues dozens of ops per gradient tensor costs milliseconds a step before it moves a byte.
This counts, with ``torch.profiler`` on CPU, the ``aten::`` ops of one whole step (forward,
backward, exchange, optimizer) that no other ``aten::`` op encloses, for one of the
benchmark's models (the synthetic ResNet-50 by default), and reports each codec's count
minus that of the same step with ``none``, divided by the model's tensors and by the tensors
the codec compresses; Triton kernel launches (``triton_fused.launches``: one each, like an
op) count as ops. It also counts the step's reads of tensor values into Python (host
syncs, which on a GPU stall the host until the device has caught up): the
``aten::_local_scalar_dense`` events (``item``, ``bool``, ``int`` and ``float`` of a tensor)
and ``aten::nonzero`` (whose output's size the host must learn). ``.tolist()`` and numpy
reads of CPU tensors emit no event and are not counted. The device path (Triton's kernels,
which CUDA tensors take) is counted on CPU under Triton's interpreter with
``HVD_COMPRESS_KERNELS=triton TRITON_INTERPRET=1``, the eager ops with
``HVD_COMPRESS_KERNELS=0``; or ``--paths kernels,device,eager`` counts each in turn in one
job (under ``TRITON_INTERPRET=1``), turning the kernels on and off in the process. A codec
with an uncompressed start
(PowerSGD's) is counted at a step after it. The counts do not depend on the link, so the
job runs on localhost:

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.op_count [--codecs ...] \
        [--model resnet50]

Rank 0 prints a Markdown table (and with ``--out``, writes it as JSON). The TensorFlow
port's ops: ``benchmarks.tf_op_count``.
"""

import argparse
import gc
import json

import horovod.torch as hvd
import torch
from torch.profiler import ProfilerActivity, profile

import hvd_compress.pt as hc
from hvd_compress.pt import fused, triton_fused
from hvd_compress.pt.device import rank_device

from .models import workload
from .protocol import OP_COUNT_PATHS as PATHS
from .protocol import added_ops, compressed_tensors
from .shapes import MODELS

# Steps before the profiled one: allocations and the compilation of the kernels.
WARMUP_STEPS = 5
# The events of a read of a tensor's values into Python: one per read (``item`` and
# ``is_nonzero`` run ``_local_scalar_dense`` inside them).
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")


def top_level_aten_ops(events):
    """The ``aten::`` events that have no ``aten::`` event among their ancestors, but for
    those Triton's interpreter makes to run a kernel (``triton_fused.INTERPRETER_RANGE``:
    the launch counts once, as on a GPU)."""
    count = 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            if parent.name == triton_fused.INTERPRETER_RANGE:
                break
            parent = parent.cpu_parent
        count += parent is None
    return count


def host_reads(events):
    """The reads of tensor values into Python among ``events`` (``HOST_READS``)."""
    return sum(event.name in HOST_READS for event in events)


def count(model_name, codec, device):
    """Top-level aten ops and host reads of one step on ``device`` past the codec's warm-up,
    the model's tensors and those compressed."""
    # The last count's optimizer and pipeline refer to each other: collected before this
    # one's model is built, as four ranks of a 25M model share the machine's memory.
    gc.collect()
    work = workload(model_name, hvd.rank(), hvd.size())
    model = work.build().to(device)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        model.named_parameters(),
        compression=codec,
    )
    inputs, targets = (t.to(device) for t in next(work.batches(0)))

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(max(WARMUP_STEPS, optimizer._hvdc_pipeline.codec.uncompressed_steps + 1)):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        launched = triton_fused.launches
        step()
        launched = triton_fused.launches - launched
    tensors = optimizer.compression_stats()["tensors"]
    events = profiler.events()
    return (
        top_level_aten_ops(events) + launched,
        host_reads(events),
        len(tensors),
        compressed_tensors(tensors),
    )


def _take(path):
    """Sends this process's CPU tensors down ``path`` (a key of ``PATHS``)."""
    _, cpu_kernels, device_path = PATHS[path]
    if device_path and not triton_fused.INTERPRETED:
        raise SystemExit("--paths device runs Triton's kernels on CPU: set TRITON_INTERPRET=1")
    fused.ENABLED = cpu_kernels
    triton_fused.ENABLED = triton_fused.ON_CPU = device_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,nuqsgd,ef-sign,powersgd,dgc")
    parser.add_argument("--model", default="resnet50", choices=MODELS)
    parser.add_argument(
        "--out", help="also write the counts as JSON here (rank 0): a list, one per path"
    )
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="cuda: each rank's own GPU"
    )
    parser.add_argument(
        "--paths",
        help=f"count each of these paths in turn ({','.join(PATHS)}); default: the path "
        f"the environment sets",
    )
    args = parser.parse_args(argv)
    hvd.init()
    device = rank_device() if args.device == "cuda" else torch.device("cpu")
    results = []
    for path in args.paths.split(",") if args.paths else [None]:
        if path is not None:
            _take(path)
        results.append(_counted(args, device, None if path is None else PATHS[path][0]))
    if hvd.rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def _counted(args, device, path):
    """The counts of ``args.codecs`` on the path the process is set to (named ``path``),
    printed by rank 0."""
    baseline, baseline_reads, _, _ = count(args.model, "none", device)
    rows = []
    for name in args.codecs.split(","):
        ops, reads, tensors, compressed = count(args.model, name, device)
        rows.append(
            {
                **added_ops(name, ops, baseline, tensors, compressed),
                "host_reads": reads,
                "added_host_reads": reads - baseline_reads,
            }
        )
    if hvd.rank() == 0:
        print(
            f"Top-level aten ops and host reads of one step, {args.model}, N = {hvd.size()}"
            f"{'' if path is None else f', {path}'} "
            f"(none: {baseline} ops, {baseline_reads} reads):\n"
        )
        print(
            "| codec | ops | added | added per tensor | compressed tensors | "
            "added per compressed tensor | added host reads |\n|---|---|---|---|---|---|---|"
        )
        for r in rows:
            per = r["added_per_compressed_tensor"]
            print(
                f"| {r['codec']} | {r['ops']:,} | {r['added']:,} | "
                f"{r['added_per_tensor']:.1f} (of {r['tensors']}) | "
                f"{r['compressed_tensors']} | {'-' if per is None else f'{per:.1f}'} | "
                f"{r['added_host_reads']} |"
            )
    counts = {
        "model": args.model,
        "world_size": hvd.size(),
        "none": baseline,
        "none_host_reads": baseline_reads,
        "codecs": rows,
    }
    return counts if path is None else {**counts, "path": path}


if __name__ == "__main__":
    main()
