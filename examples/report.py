"""What a training run of the examples reports: test accuracy, the bytes handed to Horovod per
worker and step, the compression ratio, the median step time and, per layer kind, the ratio
and density of sparse codecs. Rank 0 prints it and writes it as JSON for ``hvd-compress
demo``, with the same keys for every example and framework."""

import collections
import json
import math
import statistics


class RunRecord:
    """Every step's time and the compression statistics its optimizer reported."""

    def __init__(self):
        self.seconds, self.handed = [], []
        # Per layer kind, summed over the steps: bytes handed, bytes a plain allreduce would
        # hand, and the per-step densities.
        self.layers = collections.defaultdict(collections.Counter)

    def record(self, seconds, stats):
        """Adds one step: its duration and the optimizer's ``compression_stats()``."""
        self.seconds.append(seconds)
        self.handed.append(stats["bytes_handed"])
        for kind, layer in stats.get("layers", {}).items():
            self.layers[kind].update(
                handed=layer["bytes_handed"],
                uncompressed=layer["bytes_uncompressed"],
                density=layer["density"],
            )

    def result(self, stats, *, varying=False, **fields):
        """The run's result: ``fields`` (compression, workers, steps, test_accuracy, ...) and
        what was recorded. ``stats`` is the last ``compression_stats()``. Bytes per step are
        the median step's, since every step hands the same bytes except for variable-length
        codecs; with ``varying`` (local SGD, which hands bytes only on averaging steps;
        compressed Adam, whose warm-up steps go uncompressed) they are the total over the run
        divided by the steps."""
        handed = sum(self.handed) / len(self.handed) if varying else statistics.median(self.handed)
        steps = len(self.seconds)
        return {
            **fields,
            "codec": stats["codec"],
            "bytes_per_step": int(handed),
            "bytes_uncompressed_per_step": stats["bytes_uncompressed"],
            "compression_ratio": stats["bytes_uncompressed"] / handed,
            "median_step_ms": 1000 * statistics.median(self.seconds),
            "tensors": stats["tensors"],
            "layers": {
                kind: {
                    "compression_ratio": t["uncompressed"] / t["handed"],
                    "density": t["density"] / steps,
                }
                for kind, t in self.layers.items()
            },
        }


def language_model_result(record, stats, args, workers, nats, initial_nats):
    """The result of a language-model example (``examples/lm_torch.py``,
    ``examples/lm_keras.py``) from its ``RunRecord``, last ``compression_stats()``, command
    line (``args.lm_parser``), world size and validation loss in nats per byte after and
    before training. Under
    compressed Adam, whose warm-up steps go whole, bytes per step are the run's mean."""
    return record.result(
        stats,
        varying=stats.get("compressed_adam") is not None,
        compression=args.compression,
        workers=workers,
        steps=args.steps,
        validation_bits_per_byte=nats / math.log(2),
        initial_validation_bits_per_byte=initial_nats / math.log(2),
    )


def quality(result):
    """What a run reached: its test accuracy, or a language model's validation loss."""
    if "validation_bits_per_byte" in result:
        return f"validation {result['validation_bits_per_byte']:.3f} bits/byte"
    return f"test accuracy {100 * result['test_accuracy']:.2f}%"


def publish(result, rank, out=None, label=None):
    """Rank 0 prints ``result`` (under ``label``, the compression by default) and writes it as
    JSON to ``out``."""
    if rank != 0:
        return
    loss = f", train loss {result['train_loss']:.4f}" if "train_loss" in result else ""
    print(
        f"{label or result['compression']}: {quality(result)}{loss}, "
        f"{result['bytes_per_step']} bytes/step/worker "
        f"(ratio {result['compression_ratio']:.2f}x), "
        f"median step {result['median_step_ms']:.2f} ms",
        flush=True,
    )
    if result["layers"]:
        print(
            "  per layer kind: "
            + ", ".join(
                f"{kind} {layer['compression_ratio']:.1f}x (density {100 * layer['density']:.2f}%)"
                for kind, layer in result["layers"].items()
            )
        )
    width = max((len(name) for name, *_ in result["tensors"]), default=0)
    for name, numel, exchange, reason in result["tensors"]:
        print(f"  {name:{width}s} {numel:8d}  {exchange:26s} {reason}")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
