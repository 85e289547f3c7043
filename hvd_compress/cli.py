"""The ``hvd-compress`` command.

    hvd-compress demo [--workers 2] [--codecs none,terngrad,qsgd-inf,nuqsgd] [--steps 3000]

``demo`` is the main job: it trains the MNIST-1D CNN of ``examples/mnist1d_torch.py`` under
``horovodrun`` (Gloo, localhost) once per codec with the same seed and data, and prints a
table of test accuracy, bytes handed to Horovod per worker per step, compression ratio and
median step time.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(script, codec, args, outdir):
    out = os.path.join(outdir, f"{codec}.json")
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"),
               "-np", str(args.workers), "-H", f"localhost:{args.workers}", "--gloo",
               sys.executable, script, "--compression", codec, "--steps", str(args.steps),
               "--optimizer", args.optimizer, "--lr", str(args.lr), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"$ {' '.join(command[:7])} {os.path.relpath(script)} --compression {codec} ...",
          flush=True)
    try:
        subprocess.run(command, env=env, check=True, timeout=args.timeout,
                       stdout=subprocess.DEVNULL if not args.verbose else None)
    except subprocess.TimeoutExpired:
        sys.exit(f"demo: {codec} did not finish within {args.timeout}s")
    except subprocess.CalledProcessError as error:
        sys.exit(f"demo: {codec} failed with exit code {error.returncode}")
    with open(out) as f:
        return json.load(f)


def format_table(results):
    """A Markdown table of the demo's results; the first row is the baseline."""
    base = results[0]["test_accuracy"]
    lines = ["| codec | test accuracy | vs. " + results[0]["compression"] +
             " | bytes/step/worker | compression | median step |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['compression']} | {100 * r['test_accuracy']:.2f}% | "
            f"{100 * (r['test_accuracy'] - base):+.2f} pt | {r['bytes_per_step']:,} | "
            f"{r['compression_ratio']:.1f}x | {r['median_step_ms']:.1f} ms |")
    return "\n".join(lines)


def demo(args):
    script = os.path.join(REPO, "examples", "mnist1d_torch.py")
    if not os.path.exists(script):
        sys.exit("demo: examples/mnist1d_torch.py not found; run it from a source checkout")
    with tempfile.TemporaryDirectory() as outdir:
        results = [_run_example(script, codec, args, outdir) for codec in args.codecs]
    print(f"\nMNIST-1D CNN, {args.workers} Horovod workers over Gloo, {args.steps} steps, "
          f"{args.optimizer} lr {args.lr} (cosine), global batch 100, same seed:\n")
    print(format_table(results))
    print("\nTensors (last codec):")
    for name, numel, exchange, reason in results[-1]["tensors"]:
        print(f"  {name:14s} {numel:8d}  {exchange:26s} {reason}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hvd-compress", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="train MNIST-1D with and without compression")
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--codecs", type=lambda s: s.split(","),
                     default=["none", "terngrad", "qsgd-inf", "nuqsgd"])
    run.add_argument("--steps", type=int, default=3000)
    run.add_argument("--optimizer", default="sgd")
    run.add_argument("--lr", type=float, default=0.1)
    run.add_argument("--timeout", type=int, default=1200, help="seconds per training run")
    run.add_argument("--out", help="also write the results as JSON here")
    run.add_argument("--verbose", action="store_true", help="show the workers' output")
    args = parser.parse_args(argv)
    demo(args)


if __name__ == "__main__":
    main()
