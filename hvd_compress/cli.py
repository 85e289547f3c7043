"""The ``hvd-compress`` command.

    hvd-compress demo [--runs 2:none,2:terngrad,...,4:none,4:ef-sign] [--steps 3000]
    hvd-compress bench [--workers 2,4] [--rates 10G,1G,100M] ...   (see benchmarks/bench.py)

``demo`` is the main job: it trains the MNIST-1D CNN of ``examples/mnist1d_torch.py`` under
``horovodrun`` (Gloo, localhost) once per run (workers:codec) with the same seed and data,
and prints a table of test accuracy (against the uncompressed run with as many workers),
bytes handed to Horovod per worker per step, compression ratio and median step time.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEFAULT_RUNS = ["2:none", "2:terngrad", "2:qsgd-inf", "2:nuqsgd", "2:ef-sign", "2:adacomp"]


def _parse_runs(text):
    runs = []
    for item in text.split(","):
        workers, _, codec = item.partition(":")
        if not workers.isdigit() or int(workers) < 1 or not codec:
            raise argparse.ArgumentTypeError(
                f"--runs takes workers:codec items such as 2:none,4:ef-sign; got {item!r}")
        runs.append((int(workers), codec))
    return runs


def _run_example(script, workers, codec, args, outdir):
    out = os.path.join(outdir, f"{workers}-{codec}.json")
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"),
               "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
               sys.executable, script, "--compression", codec, "--steps", str(args.steps),
               "--optimizer", args.optimizer, "--lr", str(args.lr), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"$ {' '.join(command[:7])} {os.path.relpath(script)} --compression {codec} ...",
          flush=True)
    try:
        subprocess.run(command, env=env, check=True, timeout=args.timeout,
                       stdout=subprocess.DEVNULL if not args.verbose else None)
    except subprocess.TimeoutExpired:
        sys.exit(f"demo: {codec} on {workers} workers did not finish within {args.timeout}s")
    except subprocess.CalledProcessError as error:
        sys.exit(f"demo: {codec} on {workers} workers failed with exit code "
                 f"{error.returncode}")
    with open(out) as f:
        return json.load(f)


def format_table(results):
    """A Markdown table of the demo's results, each compared with the uncompressed run
    (``none``) with the same number of workers."""
    base = {r["workers"]: r["test_accuracy"] for r in results if r["compression"] == "none"}
    lines = ["| workers | codec | test accuracy | vs. none | bytes/step/worker | compression "
             "| median step |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        versus = f"{100 * (r['test_accuracy'] - base[r['workers']]):+.2f} pt" \
            if r["workers"] in base else "n/a"
        lines.append(
            f"| {r['workers']} | {r['compression']} | {100 * r['test_accuracy']:.2f}% | "
            f"{versus} | {r['bytes_per_step']:,} | {r['compression_ratio']:.1f}x | "
            f"{r['median_step_ms']:.1f} ms |")
    return "\n".join(lines)


def demo(args):
    script = os.path.join(REPO, "examples", "mnist1d_torch.py")
    if not os.path.exists(script):
        sys.exit("demo: examples/mnist1d_torch.py not found; run it from a source checkout")
    with tempfile.TemporaryDirectory() as outdir:
        results = [_run_example(script, workers, codec, args, outdir)
                   for workers, codec in args.runs]
    print(f"\nMNIST-1D CNN, Horovod workers over Gloo, {args.steps} steps, "
          f"{args.optimizer} lr {args.lr} (cosine), global batch 100, same seed:\n")
    print(format_table(results))
    print("\nTensors (last codec):")
    for name, numel, exchange, reason in results[-1]["tensors"]:
        print(f"  {name:14s} {numel:8d}  {exchange:26s} {reason}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def bench(argv):
    """``bench`` is the harness in the source checkout's ``benchmarks/`` (which is not
    installed with the package), like the demo's example script."""
    if not os.path.exists(os.path.join(REPO, "benchmarks", "bench.py")):
        sys.exit("bench: benchmarks/bench.py not found; run it from a source checkout")
    sys.path.insert(0, REPO)
    from benchmarks import bench as harness
    harness.main(argv)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hvd-compress", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="train MNIST-1D with and without compression")
    run.add_argument("--runs", type=_parse_runs, default=_parse_runs(",".join(DEFAULT_RUNS)),
                     help="comma-separated workers:codec runs, in order "
                          f"(default {','.join(DEFAULT_RUNS)})")
    run.add_argument("--steps", type=int, default=3000)
    run.add_argument("--optimizer", default="sgd")
    run.add_argument("--lr", type=float, default=0.1)
    run.add_argument("--timeout", type=int, default=1200, help="seconds per training run")
    run.add_argument("--out", help="also write the results as JSON here")
    run.add_argument("--verbose", action="store_true", help="show the workers' output")
    # The benchmark parses its own arguments (and --help).
    commands.add_parser("bench", add_help=False,
                        help="speed-up on a bandwidth-limited test network (needs root)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        bench(rest)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    else:
        demo(args)


if __name__ == "__main__":
    main()
