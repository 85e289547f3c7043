"""TensorFlow ops of one traced training step per codec: what compression adds per tensor,
the TensorFlow port's twin of ``benchmarks.op_count``.

A TensorFlow step is one ``tf.function``; outside a compiled (XLA) cluster each op it runs
is at least one kernel launch on a GPU. This counts the ops of the step's graph as traced
(``benchmarks.tf_worker``'s ``Trainer``: forward, backward, the tape's exchange, Keras's
SGD), through every function it calls and every branch of its conditionals, for one of the
benchmark's models (the synthetic ResNet-50 by default), and reports each codec's count
minus that of the same step with ``none``, divided by the model's tensors and by the
tensors the codec compresses, and the op types it adds most of. Constants, identities,
no-ops, the step's inputs and function arguments and results are not counted: they launch
nothing. A call of a function XLA compiles (``jit_compile=True``, as
``hvd_compress.tf.seeding.uniforms``) counts as one launch. Every branch is counted, so a
step whose conditionals take one branch runs fewer (the adaptive mode's three paths per
tensor: count its codecs forced instead). Grappler may still fold or fuse some ops when it
optimizes the graph for a device.

Three paths: ``xla`` (``HVD_COMPRESS_KERNELS=xla``: the calls ``hvd_compress.tf.xla_fused``
compiles, what a GPU's tensors take), ``ops`` (``HVD_COMPRESS_KERNELS=0``: the same ops,
uncompiled) and ``kernels`` (the CPU kernels, each call one ``tf.numpy_function`` op), or
``--paths xla,ops,kernels`` for all in one job. The counts do not depend on the link:

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.tf_op_count [--codecs ...] \
        [--model resnet50] [--paths xla,ops,kernels]

Rank 0 prints a Markdown table (and with ``--out``, writes it as JSON).
"""

import argparse
import collections
import gc
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402

from hvd_compress.tf import fused, xla_fused  # noqa: E402

from .protocol import TF_OP_COUNT_PATHS, added_ops, compressed_tensors  # noqa: E402
from .shapes import MODELS  # noqa: E402
from .tf_worker import WARMUP_STEPS, Workload, codec_trainer  # noqa: E402

# Graph nodes that launch no kernel: values known at tracing, renames, control edges and
# the function boundary (calls, the step's inputs, a function's arguments and results).
NOT_LAUNCHED = frozenset(
    {
        "Const",
        "Identity",
        "IdentityN",
        "NoOp",
        "PartitionedCall",
        "StatefulPartitionedCall",
        "Placeholder",
        "_Arg",
        "_Retval",
    }
)
# What a call of a function XLA compiles counts as: one launch of its cluster.
XLA_CLUSTER = "(XLA cluster)"
# Op types the table names for each codec, those it adds most of.
MOST_ADDED = 4
# The attributes through which a node runs other functions of the graph's library.
FUNCTION_ATTRIBUTES = ("f", "then_branch", "else_branch", "branches", "cond", "body")


def _called(node):
    """The names of the library functions ``node`` runs."""
    names = []
    for attribute in FUNCTION_ATTRIBUTES:
        if attribute not in node.attr:
            continue
        value = node.attr[attribute]
        names += [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
    return [name for name in names if name]


def _compiled(node, called, library) -> bool:
    """Whether ``node``, which runs the library functions ``called``, runs a function XLA
    compiles (``jit_compile=True``): one cluster, counted as one launch however many ops
    it holds."""
    attributes = [node.attr] + [library[name].attr for name in called]
    return any(a["_XlaMustCompile"].b for a in attributes if "_XlaMustCompile" in a)


def launched_ops(graph_def) -> collections.Counter:
    """The ops of ``graph_def`` that launch a kernel (``NOT_LAUNCHED`` aside), by op type,
    with those of every function its nodes run (each call counted, every branch); a call
    of a function XLA compiles is one ``XLA_CLUSTER``."""
    library = {function.signature.name: function for function in graph_def.library.function}
    memo = {}

    def count(nodes):
        total = collections.Counter()
        for node in nodes:
            called = _called(node)
            if node.op in library:  # a function called by its name as the op
                called.append(node.op)
            if _compiled(node, called, library):
                total[XLA_CLUSTER] += 1
                continue
            if node.op not in library and node.op not in NOT_LAUNCHED:
                total[node.op] += 1
            for name in called:
                if name not in memo:
                    memo[name] = count(library[name].node_def)
                total.update(memo[name])
        return total

    return count(graph_def.node)


def count(model_name, codec):
    """Launched ops of one traced step with ``codec`` by op type, the model's tensors and
    those compressed (0 for ``none``)."""
    gc.collect()
    work = Workload(model_name, hvd.rank(), hvd.size(), seed=0)
    run = codec_trainer(work, codec, hvd.size())
    inputs, targets = next(work.batches(0))
    for _ in range(WARMUP_STEPS):
        run.step(inputs, targets)
    graph = run._step.get_concrete_function(inputs, targets).graph.as_graph_def()
    tensors = run.tape.pipeline.compression_stats()["tensors"]
    return launched_ops(graph), len(tensors), compressed_tensors(tensors)


def _counted(args, path):
    """The counts of every codec on ``path`` (the label), printed by rank 0."""
    baseline_types, tensors, _ = count(args.model, "none")
    baseline = baseline_types.total()
    rows = []
    for codec in args.codecs.split(","):
        types, _, compressed = count(args.model, codec)
        row = added_ops(codec, types.total(), baseline, tensors, compressed)
        types.subtract(baseline_types)
        rows.append({**row, "added_by_type": dict(types.most_common(MOST_ADDED))})
    if hvd.rank() == 0:
        print(
            f"\n{args.model}: TensorFlow ops of one traced step (N = {hvd.size()}, {path}; "
            f"none: {baseline:,} ops, {tensors} tensors)\n"
        )
        print(
            "| codec | ops | added by compression | added per tensor | compressed tensors "
            "| added per compressed tensor | most added |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            per_compressed = row["added_per_compressed_tensor"]
            most = ", ".join(f"{op} {n:,}" for op, n in row["added_by_type"].items())
            print(
                f"| {row['codec']} | {row['ops']:,} | {row['added']:,} | "
                f"{row['added_per_tensor']:.1f} | {row['compressed_tensors']} | "
                f"{'-' if per_compressed is None else f'{per_compressed:.1f}'} | {most} |"
            )
    return {
        "model": args.model,
        "world_size": hvd.size(),
        "path": path,
        "none": baseline,
        "tensors": tensors,
        "codecs": rows,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,nuqsgd,ef-sign,powersgd,dgc")
    parser.add_argument("--model", default="resnet50", choices=MODELS)
    parser.add_argument(
        "--paths", default="xla", help=f"count each in turn ({','.join(TF_OP_COUNT_PATHS)})"
    )
    parser.add_argument(
        "--out", help="also write the counts as JSON here (rank 0): a list, one per path"
    )
    args = parser.parse_args(argv)
    hvd.init()
    results = []
    for path in args.paths.split(","):
        if path not in TF_OP_COUNT_PATHS:
            parser.error(f"--paths takes {', '.join(TF_OP_COUNT_PATHS)}; got {path!r}")
        label, fused.ENABLED, xla_fused.ENABLED, xla_fused.ON_CPU = TF_OP_COUNT_PATHS[path]
        results.append(_counted(args, label))
    if hvd.rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
