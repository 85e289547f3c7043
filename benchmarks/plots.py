"""The benchmark's PNG plots: speed-up against link rate, step-time breakdown with the cost
model's prediction, and MNIST-1D test accuracy against training time."""

import contextlib
import os

import matplotlib

matplotlib.use("Agg")  # files only; no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402

from .network import parse_rate  # noqa: E402
from .report import BASELINE  # noqa: E402


def _shaped(rows):
    shaped = []
    for row in rows:
        # localhost rows have no rate to plot against
        with contextlib.suppress(ValueError):
            shaped.append((parse_rate(row["rate"]), row))
    return shaped


def speedup(result, path):
    """Speed-up of the step over Horovod's fp32 allreduce against the link rate, one panel
    per model and N."""
    shaped = _shaped(result["rows"])
    panels = sorted({(row["model"], row["workers"]) for _, row in shaped})
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, (model, workers) in zip(axes[0], panels):
        mine = [
            (bits, row)
            for bits, row in shaped
            if row["model"] == model and row["workers"] == workers
        ]
        for method in dict.fromkeys(row["method"] for _, row in mine):
            points = sorted(
                (bits, row["speedup"])
                for bits, row in mine
                if row["method"] == method and row["speedup"] is not None
            )
            axis.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                label=method,
                linestyle="--" if method.startswith("ddp") else "-",
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.axhline(1.0, color="grey", linewidth=0.5)
        axis.set_title(f"{model}, N = {workers}")
        axis.set_xlabel("link rate (bit/s)")
        axis.set_ylabel(f"step speed-up over {BASELINE}")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def breakdown(result, path, rate="100M"):
    """Where a step's time goes at ``rate`` (compute, the codec's own work, waiting for
    the network), with the cost model's predicted step time as a marker."""
    rows = [row for row in result["rows"] if row["rate"] == rate]
    panels = sorted({(row["model"], row["workers"]) for row in rows})
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, (model, workers) in zip(axes[0], panels):
        mine = [row for row in rows if row["model"] == model and row["workers"] == workers]
        names = [row["method"] for row in mine]
        compute = [row["compute"] for row in mine]
        codec = [max(row["codec"] or 0.0, 0.0) for row in mine]
        rest = [row["seconds"] - c - k for row, c, k in zip(mine, compute, codec)]
        axis.bar(names, compute, label="compute")
        axis.bar(names, codec, bottom=compute, label="codec")
        axis.bar(names, rest, bottom=[c + k for c, k in zip(compute, codec)], label="communication")
        axis.scatter(
            names,
            [row["predicted"] for row in mine],
            color="black",
            marker="_",
            s=300,
            zorder=3,
            label="predicted",
        )
        axis.set_title(f"{model}, N = {workers}, {rate}bit/s")
        axis.set_ylabel("seconds per step")
        axis.tick_params(axis="x", labelrotation=60, labelsize=7)
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def accuracy(result, path):
    """MNIST-1D test accuracy against training time (evaluation excluded)."""
    curves = [e for e in result["events"] if e["kind"] == "accuracy"]
    if not curves:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    for e in curves:
        axis.plot(
            [p[0] for p in e["points"]],
            [p[2] for p in e["points"]],
            marker=".",
            label=e["method"],
            linestyle="--" if e["method"].startswith("ddp") else "-",
        )
    first = curves[0]
    axis.set_title(f"MNIST-1D CNN, N = {first['workers']}, {first['rate']}bit/s links")
    axis.set_xlabel("training time (s)")
    axis.set_ylabel("test accuracy")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_all(result, directory):
    """Writes every plot the results allow; returns the paths written."""
    written = [
        speedup(result, os.path.join(directory, "speedup.png")),
        breakdown(result, os.path.join(directory, "breakdown.png")),
        accuracy(result, os.path.join(directory, "accuracy.png")),
    ]
    return [path for path in written if path is not None]
