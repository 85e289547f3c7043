"""What the exchanges would cost on GPU clusters of 8 to 1024 workers, by the two-tier model
of ``hvd_compress.cluster``, and how that model compares with this harness's measurements.

    python -m benchmarks.projection [--out benchmarks/results]

Writes ``projection.md`` (the tables) and ``projection.png`` (speed-up over Horovod's fp32
allreduce against the number of workers) to ``--out``. The clusters, links and models are
assumptions, stated in ``ASSUMPTIONS`` and printed with the tables; the validation reads
the last ``make bench`` (``benchmarks/results/bench.json``) and the last run on nodes of two
workers (``benchmarks/results/two-tier/bench.json``, docs/benchmarks.md).
"""

import argparse
import json
import math
import os
import statistics

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

from hvd_compress import cluster, cost  # noqa: E402
from hvd_compress.registry import resolve  # noqa: E402

from .protocol import NODE_AVERAGE, TWO_LEVEL_SUFFIX  # noqa: E402
from .shapes import CLASSES, FEATURES, resnet50_convolutions  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
CODECS = ("terngrad", "qsgd-inf", "nuqsgd", "ef-sign")
CLUSTERS = ((8, 1), (8, 8), (32, 8), (128, 8))  # (nodes M, GPUs per node L)
RATES = (10e9, 25e9, 100e9)  # between nodes, bits per second
# GPU nodes: NVLink inside (A100: 300 GB/s each way per GPU), Ethernet between; a message
# round costs a few microseconds inside and tens over TCP between nodes.
INSIDE = cluster.Tier(latency=10e-6, bits_per_second=2.4e12)
BETWEEN_LATENCY = 30e-6
MEMORY_BYTES_PER_SECOND = 1.5e12  # A100's HBM2
# A 1B-parameter decoder: 16 layers of width 2048 (attention and a 4x MLP), 50,304-token
# embedding and untied output layer.
WIDTH, LAYERS, VOCABULARY, CONTEXT = 2048, 16, 50304, 2048
# Compute of one step on one GPU: ResNet-50 at 256 images (A100, mixed precision, about
# 2,700 images/s), the 1B model at 16,384 tokens (6 x 1e9 x 16,384 FLOP at 140 TFLOP/s).
COMPUTE_SECONDS = {"resnet50 (25M)": 0.095, "transformer (1B)": 0.70}
# The backward pass, which the exchange overlaps, is two thirds of the compute.
BACKWARD_SHARE = 2 / 3
ASSUMPTIONS = (
    f"Inside a node: NVLink-class, {INSIDE.bits_per_second / 8e9:.0f} GB/s each way, "
    f"{INSIDE.latency * 1e6:.0f} us per message round. Between nodes: "
    f"{', '.join(f'{r / 1e9:g}' for r in RATES)} Gbit/s, {BETWEEN_LATENCY * 1e6:.0f} us per "
    f"round. Codec passes at {MEMORY_BYTES_PER_SECOND / 1e12:g} TB/s of GPU memory. Compute "
    f"per step: {', '.join(f'{m} {s * 1e3:.0f} ms' for m, s in COMPUTE_SECONDS.items())}; the "
    f"exchange overlaps the backward pass ({BACKWARD_SHARE:.2f} of it), the codecs' passes do "
    f"not. Horovod's ring algorithms, fused in {cluster.HOROVOD_FUSION_BYTES >> 20} MB buffers."
)


def resnet50_tensors():
    """(numel, is classifier) of the synthetic ResNet-50's 161 tensors, in order."""
    tensors = []
    for out, inputs, k in resnet50_convolutions():
        tensors += [(out * inputs * k * k, False), (out, False), (out, False)]
    return tensors + [(CLASSES * FEATURES, True), (CLASSES, True)]


def transformer_tensors():
    """(numel, is classifier) of the 1B-parameter decoder's tensors."""
    d = WIDTH
    tensors = [(VOCABULARY * d, False), (CONTEXT * d, False)]  # token and position embeddings
    layer = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    tensors += [(n, False) for _ in range(LAYERS) for n in layer]
    return tensors + [(d, False), (d, False), (VOCABULARY * d, True)]


MODELS = {"resnet50 (25M)": resnet50_tensors, "transformer (1B)": transformer_tensors}


def split(codec, tensors):
    """The sizes ``codec`` compresses, and the elements it leaves whole."""
    compressed = [
        n for n, head in tensors if codec.compresses(n) and (codec.compress_classifier or not head)
    ]
    return compressed, sum(n for n, _ in tensors) - sum(compressed)


def step_seconds(compute, exchange, codec_seconds=0.0):
    """The step: compute, the codec's passes, and what of the exchange the backward pass
    does not hide."""
    return compute + codec_seconds + max(0.0, exchange - BACKWARD_SHARE * compute)


def methods(model, shape):
    """{method: step seconds} of every path on ``shape`` (a ``cluster.Cluster``)."""
    tensors = MODELS[model]()
    compute = COMPUTE_SECONDS[model]
    total = sum(n for n, _ in tensors)
    steps = {
        path: step_seconds(compute, cluster.whole_seconds(shape, total, path))
        for path in cluster.WHOLE_PATHS
    }
    for name in CODECS:
        codec = resolve(name)
        compressed, whole = split(codec, tensors)
        exchanges = list(cost.exchanges_for(codec))
        # The codec's passes after a two-level exchange: those of the exchange among the
        # nodes of a 1M-element shard (none on one node, where the shard arrives summed).
        inner = cost.two_level_inner(codec, 1 << 20, shape.nodes) if shape.nodes > 1 else None
        for exchange in exchanges + [cost.TWO_LEVEL]:
            passes = exchange if exchange != cost.TWO_LEVEL else inner or "allreduce"
            size = shape.workers if exchange != cost.TWO_LEVEL else shape.nodes
            per_element = cluster.codec_bytes_per_element(codec, passes, size)
            codec_seconds = per_element * sum(compressed) / MEMORY_BYTES_PER_SECOND
            seconds = cluster.exchange_seconds(codec, compressed, whole, shape, exchange)
            steps[f"{name} {exchange}"] = step_seconds(compute, seconds, codec_seconds)
    return steps


def projection_table(model):
    """Markdown rows: per cluster and rate, fp32's step, the fastest method and its
    speed-up, and each codec's best exchange."""
    header = ["workers", "between nodes", "fp32 allreduce (ms)", "fastest", "speed-up"]
    header += [f"{name}: best exchange" for name in CODECS]
    lines, points = [], {}
    for nodes, per_node in CLUSTERS:
        for rate in RATES:
            shape = cluster.Cluster(nodes, per_node, INSIDE, cluster.Tier(BETWEEN_LATENCY, rate))
            steps = methods(model, shape)
            fp32 = steps[cluster.FP32]
            fastest = min(steps, key=steps.get)
            row = [
                f"{nodes}x{per_node}",
                f"{rate / 1e9:g} Gbit/s",
                f"{fp32 * 1e3:,.0f}",
                fastest,
                f"{fp32 / steps[fastest]:.2f}x",
            ]
            for name in CODECS:
                mine = {m: s for m, s in steps.items() if m.startswith(name + " ")}
                best = min(mine, key=mine.get)
                row.append(f"{best.split(' ', 1)[1]} {fp32 / mine[best]:.2f}x")
                points.setdefault((name, rate), []).append((shape.workers, fp32 / mine[best]))
            points.setdefault((cluster.HIERARCHICAL, rate), []).append(
                (shape.workers, fp32 / steps[cluster.HIERARCHICAL])
            )
            lines.append(row)
    return _table(header, lines), points


def _table(header, lines):
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(rows + ["| " + " | ".join(map(str, line)) + " |" for line in lines])


def plot(points_by_model, path):
    figure, axes = plt.subplots(
        len(points_by_model), len(RATES), figsize=(4.2 * len(RATES), 3.6 * len(points_by_model))
    )
    for row, (model, points) in zip(axes, points_by_model.items()):
        for axis, rate in zip(row, RATES):
            for (name, r), series in points.items():
                if r == rate:
                    workers, speedups = zip(*series)
                    axis.plot(workers, speedups, marker="o", label=name)
            axis.axhline(1.0, color="grey", linewidth=0.8)
            axis.set_xscale("log", base=2)
            axis.set_title(f"{model}, {rate / 1e9:g} Gbit/s between nodes", fontsize=9)
            axis.set_xlabel("workers (8x1, 8x8, 32x8, 128x8)")
            axis.set_ylabel("step speed-up over fp32")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


HARNESS_METHODS = ("hvd-none", "hvd-fp16", "terngrad", "qsgd-inf", "ef-sign")
HARNESS_MODELS = {"resnet50": resnet50_tensors}
# The run on nodes of several workers (its two-level methods: ``<codec>-2l``).
NODES_RESULT = os.path.join("two-tier", "bench.json")

# Latencies per message round tried in the fit to the harness's bare collectives, at the
# rates where the link, not the CPU of 4 ranks on 2 cores, bounds them.
LATENCY_GRID = [10 ** (e / 8) for e in range(-40, -15)]  # 10 us .. 7.5 ms
FIT_RATES = ("100M", "1G")


def _bare_seconds(exchange, total, shape):
    """The model's time of one of the harness's bare exchanges of ``total`` elements
    (``benchmarks.collectives``)."""
    tier, n = shape.flat_tier, shape.workers
    if exchange == "fp32 allreduce":
        return cluster.allreduce(tier, n, 4 * total)
    if exchange == "fp16 allreduce":
        return cluster.allreduce(tier, n, 2 * total)
    if exchange == "2-bit allgather":
        return cluster.allgather(tier, n, -(-total // 4))
    shard = -(-total // (8 * n))
    return cluster.alltoall(tier, n, n * shard) + cluster.allgather(tier, n, shard)


def _harness(result_path):
    with open(os.path.join(RESULTS, result_path)) as f:
        return json.load(f)


def fit_latency(result):
    """The latency per message round that best predicts the run's bare collectives at
    ``FIT_RATES`` (least squares of the logs of predicted over measured), with its errors
    there: the network tier of the harness."""
    from .network import parse_rate

    bare = [
        e
        for e in result["events"]
        if e["kind"] == "bare" and e["model"] in HARNESS_MODELS and e["rate"] in FIT_RATES
    ]

    def errors(latency):
        out = []
        for e in bare:
            total = sum(n for n, _ in HARNESS_MODELS[e["model"]]())
            shape = cluster.Cluster(
                e["workers"], 1, INSIDE, cluster.Tier(latency, parse_rate(e["rate"]))
            )
            for exchange, measured in e["exchanges"].items():
                predicted = _bare_seconds(exchange, total, shape)
                out.append((e["workers"], e["rate"], exchange, measured["seconds"], predicted))
        return out

    def spread(latency):
        return sum(math.log(p / m) ** 2 for *_, m, p in errors(latency))

    latency = min(LATENCY_GRID, key=spread)
    return latency, errors(latency)


def validate(result, latency, inside=INSIDE):
    """(N, rate, method, measured step, predicted step) of the run's PyTorch rows: compute
    and codec time as measured, the exchange by the model with the harness's links
    (``exchange="auto"``'s routes for the codecs). On nodes of several workers (the run's
    ``per_node``) ``inside`` is the tier within a node, and the two-level methods' nodes
    average by an allreduce, as CPU tensors do."""
    from .network import parse_rate

    per_node = result["spec"].get("per_node", 1)
    lines = []
    for r in result["rows"]:
        method = r["method"]
        two_level = method.endswith(TWO_LEVEL_SUFFIX)
        flat = method.removesuffix(TWO_LEVEL_SUFFIX)
        if r["model"] not in HARNESS_MODELS or flat not in HARNESS_METHODS:
            continue
        tensors = HARNESS_MODELS[r["model"]]()
        shape = cluster.Cluster(
            r["workers"] // per_node,
            per_node,
            inside,
            cluster.Tier(latency, parse_rate(r["rate"])),
        )
        if method.startswith("hvd-"):
            path = cluster.FP32 if method == "hvd-none" else cluster.FP16
            exchange = cluster.whole_seconds(shape, sum(n for n, _ in tensors), path)
        else:
            codec = resolve(flat)
            compressed, whole = split(codec, tensors)
            route = cost.TWO_LEVEL if two_level else "auto"
            exchange = cluster.exchange_seconds(
                codec, compressed, whole, shape, route, node_allreduce=True
            )
        predicted = r["compute"] + (r["codec"] or 0.0) + exchange
        lines.append((r["workers"], r["rate"], method, r["seconds"], predicted))
    return lines


def fit_inside(result):
    """The tier inside the run's nodes: the bandwidth at which the model's node average
    and allgather (``cluster.exchange_seconds``'s, for CPU tensors) take as long as the
    bare ones measured (``NODE_AVERAGE``: the median over the rates, which shape only the
    links between nodes), with no latency: 100 MB a step in a few fused buffers, which
    bandwidth dominates."""
    measured = [
        e["exchanges"][NODE_AVERAGE]
        for e in result["events"]
        if e["kind"] == "bare" and e["model"] in HARNESS_MODELS and NODE_AVERAGE in e["exchanges"]
    ]
    seconds = statistics.median(m["seconds"] for m in measured)
    return cluster.Tier(0.0, 8 * measured[0]["sent"] / seconds)


def validation_markdown():
    result = _harness("bench.json")
    latency, bare = fit_latency(result)
    steps = validate(result, latency)
    on_nodes = _harness(NODES_RESULT)
    inside = fit_inside(on_nodes)
    node_steps = validate(on_nodes, latency, inside)

    def rows(lines):
        return [
            [n, rate, what, f"{m * 1e3:,.0f}", f"{p * 1e3:,.0f}", f"{p / m - 1:+.0%}"]
            for n, rate, what, m, p in lines
        ]

    def within(lines):
        return sum(abs(p / m - 1) <= 0.2 for *_, m, p in lines)

    header = ["N", "rate", "{}", "measured (ms)", "predicted (ms)", "error"]
    per_node = on_nodes["spec"]["per_node"]
    return "\n\n".join(
        [
            f"Fitted latency per message round: {latency * 1e3:.2f} ms (least squares of "
            f"the log errors over the bare collectives of `benchmarks/results/bench.json` at "
            f"{' and '.join(FIT_RATES)}).",
            _table([h.format("bare exchange") for h in header], rows(bare)),
            f"Steps (compute and codec time as measured): {within(steps)} of {len(steps)} "
            f"within 20%.",
            _table([h.format("method") for h in header], rows(steps)),
            f"On nodes of {per_node} workers (`benchmarks/results/two-tier/bench.json`; "
            f'the `-2l` methods are `exchange="two-level"`), with the latency above between '
            f"the nodes and, inside them, the bandwidth of the run's bare node average and "
            f"allgather ({inside.bits_per_second / 1e9:.2f} Gbit/s, no latency): "
            f"{within(node_steps)} of {len(node_steps)} within 20%.",
            _table([h.format("method") for h in header], rows(node_steps)),
        ]
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS, help=f"output directory (default {RESULTS})")
    args = parser.parse_args(argv)
    parts, points = [ASSUMPTIONS], {}
    for model in MODELS:
        table, points[model] = projection_table(model)
        parts += [f"### {model}", table]
    parts += ["### The model against this harness", validation_markdown()]
    text = "\n\n".join(parts) + "\n"
    with open(os.path.join(args.out, "projection.md"), "w") as f:
        f.write(text)
    plot(points, os.path.join(args.out, "projection.png"))
    print(text)


if __name__ == "__main__":
    main()
