"""The ``hvd-compress`` command.

    hvd-compress demo [--full | --defaults | --runs 2:none,2:terngrad,...,gru/4:local]
                      [--steps 3000] [--optimizer sgd] [--seed 0 | --seeds 0,1,2]
    hvd-compress bench [--workers 2,4] [--rates 10G,1G,100M] ...   (see benchmarks/bench.py)

``demo`` is the main job: it trains under ``horovodrun`` (Gloo, localhost) once per run,
``[model/]workers:codec[@optimizer]``, with the same seed and data for every run of a model,
and prints a table of test accuracy on MNIST-1D or a language model's validation loss
(against the baseline run of the same model, worker count and optimizer), bytes handed to
Horovod per worker per step, compression ratio and median step time. By default it runs
``DEFAULT_RUNS``, a representative subset (about 5 minutes on 2 cores); ``--full`` runs
every model and codec, ``FULL_RUNS`` (about 80 minutes); ``--defaults`` every codec by its
name alone, ``DEFAULTS_RUNS``, and ``--seeds`` repeats the runs per seed. The models are
the examples' scripts (``EXAMPLES``): the PyTorch CNN (``cnn``, the default), the same CNN
in Keras with ``model.fit`` (``keras``), the GRU of the CELGC example (``gru``), whose
"codecs" are ``sync`` (clipped synchronous SGD, its baseline) and ``local``
(``LocalClipSGD``, averaging every 8 steps), and a byte-level transformer language model
trained with AdamW on the Python standard library's source (``lm``; the same in Keras with
``model.fit``, ``keras-lm``; ``corpus``). A codec may carry hyperparameters, as
in ``4:ef-sign:max_block_size=256`` (``hvd_compress.registry.resolve``),
a PyTorch CNN's codec the suffix ``+auto`` for the adaptive mode (``2:terngrad+auto``), a
CNN's codec ``+sgd-form`` for its worker momentum in the SGD's own form (``2:dgc+sgd-form``;
``worker_momentum=True``), and a
language model's the suffix ``+cadam`` for compressed Adam (``lm/2:nuqsgd+cadam``) and
``+no-cadam`` for none where the wrappers would choose it (``lm/2:ef-sign+no-cadam``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from hvd_compress import examples
from hvd_compress.examples import corpus
from hvd_compress.registry import CODECS

# The source checkout, when running from one: the benchmark harness (benchmarks/) is not
# installed with the package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Example:
    """A model of the demo: its example script, its baseline run, the script's arguments for a
    run of ``codec``, and the optimizer it brings (None: the demo's ``--optimizer``)."""

    def __init__(self, script, title, baseline, arguments, optimizer=None):
        self.script, self.title, self.baseline = script, title, baseline
        self.arguments, self.optimizer = arguments, optimizer

    @property
    def path(self):
        """The script inside the installed package (``hvd_compress.examples``, the checkout's
        ``examples/``), so that the demo runs from a wheel as from a checkout."""
        return os.path.join(os.path.dirname(examples.__file__), self.script)


# A CNN run's codec with this suffix runs in the adaptive mode (PyTorch only); with the
# other, the worker momentum takes the SGD's own form where the wrappers would choose
# Nesterov's (``hvd_compress.remedies``).
ADAPTIVE_SUFFIX = "+auto"
SGD_FORM_SUFFIX = "+sgd-form"


def _cnn_arguments(codec, optimizer, args):
    options = []
    for suffix, option in (
        (ADAPTIVE_SUFFIX, ["--adaptive"]),
        (SGD_FORM_SUFFIX, ["--worker-momentum", "sgd"]),
    ):
        if codec.endswith(suffix):
            codec, options = codec.removesuffix(suffix), options + option
    return [
        "--compression",
        codec,
        "--steps",
        str(args.steps),
        "--optimizer",
        optimizer,
        "--lr",
        str(args.lr),
        *options,
    ]


def _gru_arguments(mode, optimizer, args):
    if mode not in ("sync", "local") or optimizer is not None:
        raise argparse.ArgumentTypeError(
            f"gru runs are gru/workers:sync or gru/workers:local (the example's own SGD); got "
            f"{mode!r}{'' if optimizer is None else ' @' + optimizer}"
        )
    return ["--mode", mode]  # the example's own schedule: 2000 steps, I = 8


# A language model's codec with this suffix runs in the compressed-Adam mode, with the first
# COMPRESSED_ADAM_WARMUP of the 600 steps uncompressed (T_w); with the other, without it,
# where the wrappers would turn it on (``hvd_compress.remedies``).
COMPRESSED_ADAM_SUFFIX = "+cadam"
WITHOUT_COMPRESSED_ADAM_SUFFIX = "+no-cadam"
COMPRESSED_ADAM_WARMUP = 200


def _lm_arguments(codec, optimizer, args):
    if optimizer is not None:
        raise argparse.ArgumentTypeError(
            f"lm and keras-lm runs are <model>/workers:codec with the example's own AdamW; "
            f"got @{optimizer}"
        )
    # The example's own schedule: 600 steps.
    for suffix, warmup in (
        (COMPRESSED_ADAM_SUFFIX, COMPRESSED_ADAM_WARMUP),
        (WITHOUT_COMPRESSED_ADAM_SUFFIX, 0),
    ):
        if codec.endswith(suffix):
            return ["--compression", codec.removesuffix(suffix), "--compressed-adam", str(warmup)]
    return ["--compression", codec]


EXAMPLES = {
    "cnn": Example("mnist1d_torch.py", "PyTorch CNN", "none", _cnn_arguments),
    "keras": Example("mnist1d_keras.py", "Keras CNN, model.fit", "none", _cnn_arguments),
    "gru": Example(
        "mnist1d_gru_torch.py", "PyTorch GRU, CELGC", "sync", _gru_arguments, "clipped sgd"
    ),
    "lm": Example(
        "lm_torch.py", "PyTorch byte-level transformer LM", "none", _lm_arguments, "adamw"
    ),
    "keras-lm": Example(
        "lm_keras.py", "Keras byte-level transformer LM, model.fit", "none", _lm_arguments, "adamw"
    ),
}

# ef-sign as dist-EF-blockSGDM, with Nesterov momentum, in blocks of at most 256 elements: with
# heavy-ball momentum or one scale per whole tensor it ended 1.4 to 3 points below
# uncompressed SGD at 4 workers, while Nesterov momentum cost TernGrad and NUQSGD 2 points
# (docs/algorithms.md, dist-EF-blockSGD). Each run is compared with `none` under its own
# optimizer, so ef-sign brings its Nesterov baseline.
EF_SIGN = "ef-sign:max_block_size=256@nesterov"
# The codecs the peers ship (DDP's PowerSGD, GRACE's and BytePS's top-k as DGC).
PEER_RUNS = ("2:powersgd", "2:dgc")
# Every model and codec (--full, ~80 minutes on 2 cores): the accuracy claims of the README.
FULL_RUNS = (
    [
        "2:none",
        "2:terngrad",
        "2:terngrad+auto",
        "2:qsgd-inf",
        "2:nuqsgd",
        "2:adacomp",
        "2:clt-k",
        *PEER_RUNS,
        "2:none@nesterov",
        f"2:{EF_SIGN}",
        "4:none@nesterov",
        f"4:{EF_SIGN}",
        "keras/2:none@nesterov",
        f"keras/2:{EF_SIGN}",
        "gru/4:sync",
        "gru/4:local",
    ]
    + [
        f"lm/2:{codec}"
        for codec in (
            "none",
            "fp16",
            "terngrad",
            "qsgd",
            "qsgd-inf",
            "nuqsgd",
            "ef-sign",
            "adacomp",
            "clt-k",
            "ef-sign+no-cadam",
            "adacomp+no-cadam",
            "clt-k+no-cadam",
            "nuqsgd+cadam",
        )
    ]
    + [f"lm/4:{codec}" for codec in ("none", "terngrad", "ef-sign")]
    + [f"keras-lm/2:{codec}" for codec in ("none", "terngrad", "qsgd-inf", "ef-sign")]
)
# What a newcomer waits for (~5 minutes): one codec of each kind (ternary, uniform 4-bit,
# 1-bit with error feedback) by its name alone, beside the baseline. The steps stay the full
# schedule's: at half of it TernGrad ended 2.4 points below its baseline on seed 0
# (docs/benchmarks.md), which would make the table misleading.
DEFAULT_RUNS = ["2:none", "2:terngrad", "2:qsgd-inf", "2:ef-sign"]
OPTIMIZERS = ("sgd", "nesterov", "adam")
# Every codec by its name alone, as a user turns it on (--defaults): the CNN under heavy-ball
# and Nesterov momentum and the LM under AdamW, at 2 workers, each beside its baseline; about
# an hour a seed on 2 cores. The measure of the defaults (hvd_compress.remedies).
DEFAULTS_RUNS = [
    f"2:{codec}@{optimizer}" for optimizer in ("sgd", "nesterov") for codec in CODECS
] + [f"lm/2:{codec}" for codec in CODECS]


class Run:
    def __init__(self, model, workers, codec, optimizer):
        self.model, self.workers, self.codec = model, workers, codec
        self.optimizer = optimizer  # None: the demo's --optimizer

    def __str__(self):
        at = "" if self.optimizer is None else f"@{self.optimizer}"
        return f"{self.model}/{self.workers}:{self.codec}{at}"


def _parse_runs(text):
    runs = []
    for item in text.split(","):
        model, _, rest = item.rpartition("/")
        rest, at, optimizer = rest.partition("@")
        workers, _, codec = rest.partition(":")
        model = model or "cnn"
        if (
            model not in EXAMPLES
            or not workers.isdigit()
            or int(workers) < 1
            or not codec
            or at
            and optimizer not in OPTIMIZERS
        ):
            raise argparse.ArgumentTypeError(
                f"--runs takes [model/]workers:codec[@optimizer] items such as "
                f"2:none,keras/2:terngrad@nesterov,gru/4:local with model one of "
                f"{', '.join(EXAMPLES)} and optimizer one of {', '.join(OPTIMIZERS)}; got "
                f"{item!r}"
            )
        run = Run(model, int(workers), codec, optimizer if at else None)
        if EXAMPLES[model].optimizer is not None:  # checks the run's codec and optimizer
            EXAMPLES[model].arguments(codec, run.optimizer, None)
        runs.append(run)
    return runs


def _parse_seeds(text):
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"--seeds takes distinct integers >= 0 separated by commas, such as 0,1,2; got {text!r}"
        )
    return seeds


def _run_example(run, args, outdir, log):
    out = os.path.join(outdir, f"{run}-seed{args.seed}.json".replace("/", "-"))
    example = EXAMPLES[run.model]
    optimizer = None if example.optimizer else run.optimizer or args.optimizer
    command = [
        os.path.join(os.path.dirname(sys.executable), "horovodrun"),
        "-np",
        str(run.workers),
        "-H",
        f"localhost:{run.workers}",
        "--gloo",
        sys.executable,
        EXAMPLES[run.model].path,
        *EXAMPLES[run.model].arguments(run.codec, optimizer, args),
        "--seed",
        str(args.seed),
        "--out",
        out,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log(f"$ {' '.join(command[:7])} {os.path.relpath(command[7])} {' '.join(command[8:10])} ...")
    try:
        subprocess.run(
            command,
            env=env,
            check=True,
            timeout=args.timeout,
            stdout=subprocess.DEVNULL if not args.verbose else None,
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"demo: {run} did not finish within {args.timeout}s")
    except subprocess.CalledProcessError as error:
        sys.exit(f"demo: {run} failed with exit code {error.returncode}")
    with open(out) as f:
        return dict(
            json.load(f), model=run.model, label=run.codec, optimizer=optimizer or example.optimizer
        )


def _configuration(result):
    """What a run is, its seed apart."""
    return result["model"], result["workers"], result["optimizer"], result["label"]


def baseline_result(results, result):
    """The baseline run with the model, workers, optimizer and seed of ``result``, or
    None."""
    model, workers, optimizer, _ = _configuration(result)
    wanted = (model, workers, optimizer, EXAMPLES[model].baseline)
    return next(
        (r for r in results if _configuration(r) == wanted and r.get("seed") == result.get("seed")),
        None,
    )


def baseline_accuracy(results, result):
    """Test accuracy of the baseline run of ``result`` (a classifier's), or None."""
    base = baseline_result(results, result)
    return None if base is None else base["test_accuracy"]


def _quality(result, base):
    """A result's cell and its difference to its baseline ``base`` (None: n/a): test
    accuracy in points, or a language model's validation loss in bits per byte."""
    if "validation_bits_per_byte" in result:
        bits = result["validation_bits_per_byte"]
        return (
            f"{bits:.3f} bits/byte",
            "n/a" if base is None else f"{bits - base['validation_bits_per_byte']:+.3f} bits/byte",
        )
    accuracy = result["test_accuracy"]
    return (
        f"{100 * accuracy:.2f}%",
        "n/a" if base is None else f"{100 * (accuracy - base['test_accuracy']):+.2f} pt",
    )


def format_table(results):
    """A Markdown table of the demo's results, each compared with the baseline run (``none``,
    or ``sync`` for the GRU) of the same model with the same workers and optimizer."""
    measures = ["test accuracy" if "test_accuracy" in r else "validation loss" for r in results]
    lines = [
        f"| model | workers | optimizer | codec | {' or '.join(dict.fromkeys(measures))} "
        "| vs. baseline | bytes/step/worker | compression | median step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        quality, versus = _quality(r, baseline_result(results, r))
        lines.append(
            f"| {EXAMPLES[r['model']].title} | {r['workers']} | "
            f"{r['optimizer']} | {r['label']} | "
            f"{quality} | {versus} | {r['bytes_per_step']:,} | "
            f"{r['compression_ratio']:.1f}x | {r['median_step_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def _gap(result, base):
    """``result``'s difference to its baseline: points of test accuracy, or bits per byte
    of a language model's validation loss."""
    if "validation_bits_per_byte" in result:
        return result["validation_bits_per_byte"] - base["validation_bits_per_byte"]
    return 100 * (result["test_accuracy"] - base["test_accuracy"])


def format_seeds_table(results, seeds):
    """A Markdown table of runs repeated over ``seeds``: each configuration's gap to the
    baseline of its seed (points of accuracy, or bits per byte), their mean and spread."""
    rows = {}
    for r in results:
        base = baseline_result(results, r)
        if base is not None and base is not r:
            rows.setdefault(_configuration(r), {})[r["seed"]] = _gap(r, base)
    lines = [
        "| model | workers | optimizer | codec | "
        + " | ".join(f"seed {seed}" for seed in seeds)
        + " | mean gap | spread |",
        "|---|---|---|---|" + "---|" * (len(seeds) + 2),
    ]
    for (model, workers, optimizer, label), gaps in rows.items():
        values = [gaps[seed] for seed in seeds if seed in gaps]
        cells = [f"{gaps[seed]:+.3f}" if seed in gaps else "-" for seed in seeds]
        lines.append(
            f"| {EXAMPLES[model].title} | {workers} | {optimizer} | {label} | "
            + " | ".join(cells)
            + f" | {sum(values) / len(values):+.3f} | {max(values) - min(values):.3f} |"
        )
    return "\n".join(lines)


def demo(args):
    if args.runs is None:
        chosen = FULL_RUNS if args.full else DEFAULTS_RUNS if args.defaults else DEFAULT_RUNS
        args.runs = _parse_runs(",".join(chosen))
    seeds = args.seeds or [args.seed]
    # Imported here: tqdm comes with the demo's extra (``data``), which bench does not need.
    # The bar and the commands above it (tqdm.write) go to stderr, so stdout keeps the table.
    from tqdm import tqdm

    runs = [(seed, run) for seed in seeds for run in args.runs]
    with (
        tempfile.TemporaryDirectory() as outdir,
        tqdm(runs, desc="demo", unit="run", file=sys.stderr) as bar,
    ):
        results = []
        for seed, run in bar:
            bar.set_postfix_str(f"{run}, seed {seed}")
            args.seed = seed
            results.append(dict(_run_example(run, args, outdir, log=bar.write), seed=seed))
    models = {run.model for run in args.runs}
    seeded = f"seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    settings = [f"Horovod workers over Gloo, {seeded} and the same data for every run."]
    if models & {"cnn", "keras", "gru"}:
        settings.append("MNIST-1D.")
    if models & {"cnn", "keras"}:
        settings.append(
            f"CNNs: {args.steps} steps, lr {args.lr} (cosine), global batch 100, momentum 0.9."
        )
    if "gru" in models:
        settings.append(
            "GRU: the example's 2000 steps, global batch 128, lr 3.0, gamma 1.0 (cosine)."
        )
    if models & {"lm", "keras-lm"}:
        settings.append(
            f"LM: {corpus.describe()}; the example's 600 steps of AdamW (lr "
            f"0.002, 60 warm-up steps, cosine, weight decay 0.1, norm clipped at "
            f"1), global batch 16 x 64 bytes."
        )
    print("\n" + " ".join(settings) + "\n")
    print(format_table(results) if len(seeds) == 1 else format_seeds_table(results, seeds))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def bench(argv):
    """``bench`` is the harness in the source checkout's ``benchmarks/``, which is not
    installed with the package (unlike the demo's example scripts)."""
    if not os.path.exists(os.path.join(REPO, "benchmarks", "bench.py")):
        sys.exit(
            "bench: the benchmark harness (benchmarks/bench.py) is not installed with the "
            "package; run `hvd-compress bench` from a source checkout with the package "
            "installed from it (`pip install -e .`); `hvd-compress demo` needs no checkout"
        )
    sys.path.insert(0, REPO)
    from benchmarks import bench as harness

    harness.main(argv)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hvd-compress", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="train MNIST-1D with and without compression")
    which = run.add_mutually_exclusive_group()
    which.add_argument(
        "--runs",
        type=_parse_runs,
        help="comma-separated [model/]workers:codec runs, in order (default "
        f"{','.join(DEFAULT_RUNS)}: ~5 minutes on 2 cores)",
    )
    which.add_argument(
        "--full",
        action="store_true",
        help=f"every model and codec (~80 minutes on 2 cores): {','.join(FULL_RUNS)}",
    )
    which.add_argument(
        "--defaults",
        action="store_true",
        help="every codec by its name alone: the CNN under heavy-ball and Nesterov "
        "momentum, the LM under AdamW, at 2 workers (~1 hour a seed on 2 cores)",
    )
    run.add_argument(
        "--steps",
        type=int,
        default=3000,
        help="training steps of the CNN runs (default 3000); the GRU runs the "
        "2000 of its example's schedule",
    )
    run.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZERS,
        help="for the CNN runs without @optimizer: SGD with heavy-ball (sgd, "
        "default) or Nesterov momentum 0.9, or Adam",
    )
    run.add_argument("--lr", type=float, default=0.1)
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="every run's seed: its initialization, batches and codec draws "
        "(default 0; the data stay the same)",
    )
    run.add_argument(
        "--seeds",
        type=_parse_seeds,
        help="comma-separated seeds: every run once per seed, and a table of each "
        "configuration's gap to its baseline per seed, its mean and spread",
    )
    run.add_argument("--timeout", type=int, default=1200, help="seconds per training run")
    run.add_argument("--out", help="also write the results as JSON here")
    run.add_argument("--verbose", action="store_true", help="show the workers' output")
    # The benchmark parses its own arguments (and --help).
    commands.add_parser(
        "bench",
        add_help=False,
        help="speed-up on a bandwidth-limited test network (needs root and a source checkout)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        bench(rest)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    else:
        demo(args)


if __name__ == "__main__":
    main()
