"""``hvd-compress bench``: gradient exchange on a bandwidth-limited network, one Horovod worker
per network namespace, every link shaped with ``tc tbf`` (``benchmarks.network``).

    hvd-compress bench                 # the whole matrix (make bench), about 50 minutes
    hvd-compress bench --workers 2 --rates 100M --models cnn --steps 3 --no-accuracy
    hvd-compress bench --workers 4 --per-node 2 --methods hvd-none,ef-sign,ef-sign-2l ...

For each number of workers N the driver builds the test network (N nodes of one worker, or
with ``--per-node L`` N / L nodes of L workers, shaped only between nodes), starts one Horovod job
(``benchmarks.worker`` on every rank), then one of the TensorFlow port
(``benchmarks.tf_worker``), and changes the link rate whenever rank 0 asks for it.
Per model, N, rate and method it records the median step time, the local compute time, the
time blocked waiting for Horovod, bytes handed to the collectives, the cost model's bytes on
the network, the bytes the interfaces counted, and the same collectives replayed bare. It
writes ``bench.json``, ``bench.md`` (the tables) and PNG plots to ``--out``.

Without root (or without network namespaces) it falls back to localhost, unshaped, and says
so: the harness still runs, but the times are not those of a limited link.
"""

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import threading

from tqdm import tqdm

from . import network, plots, report, ssh_hosts
from .job import HorovodJob, LocalHosts, NamespacedHosts, SshLaunchedHosts
from .methods import (
    ACCURACY_CHOICES,
    ACCURACY_CODECS,
    CODEC_METHODS,
    METHODS,
    PEER_METHODS,
    TWO_LEVEL_METHODS,
)
from .protocol import (
    AUTO_SUFFIX,
    LONG_SECONDS,
    OP_COUNT_PATHS,
    STEP_BUDGET_SECONDS,
    TF_METHODS,
    TF_OP_COUNT_PATHS,
    TF_PREFIX,
    event_of,
    shaped_path,
)
from .shapes import MODELS

DEFAULT_WORKERS = (2, 4)
# The TensorFlow methods of one job, but for the adaptive ones (``tf_jobs``).
TF_METHODS_PER_JOB = 3
DEFAULT_RATES = ("10G", "1G", "100M")
# The peers' codecs run on request (--methods): one worker process measures every method
# of a model and N in turn, keeping ~400 MB more per method at the 25M-parameter model, and
# with them the four workers of N = 4 outgrew the 24 GiB of this project's machines.
# The two-level exchanges run on request too: they need nodes of several workers.
DEFAULT_METHODS = tuple(m for m in METHODS if m not in PEER_METHODS + TWO_LEVEL_METHODS)
# Every codec by its name alone, as a user turns it on, beside Horovod's uncompressed
# allreduce and DDP's PowerSGD hook.
ACCURACY_METHODS = ("hvd-none", *ACCURACY_CODECS, "ddp-powersgd")
# A bound on one step of an accuracy run with its share of the evaluations, for the job's
# timeout: three times the slowest codec's pace at 100 Mbit/s on 2 cores.
ACCURACY_STEP_SECONDS = 0.2
LOCALHOST = "localhost"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results")


def timed_steps(model):
    """(least, most) timed steps per configuration: as many as take
    ``STEP_BUDGET_SECONDS`` within these, one where a step takes ``LONG_SECONDS`` or more
    (the 25M-parameter model's uncompressed step takes ~14 s at 100 Mbit/s and 4 workers).
    The medians of the first 3 (CNN: 10) of 5 (20) steps are 5% (6%) from the full
    medians on average, 54% (32%) at most, in CPU-bound configurations whose step times
    spread as widely between runs."""
    return (10, 30) if model == "cnn" else (3, 7)


def _list(kind, choices=None, convert=str):
    def parse(text):
        items = [convert(item) for item in text.split(",") if item]
        unknown = [item for item in items if choices is not None and item not in choices]
        if not items or unknown:
            raise argparse.ArgumentTypeError(
                f"{kind} must be a comma-separated list of {', '.join(map(str, choices))}"
                if choices
                else f"{kind} must be a comma-separated list"
            )
        return items

    return parse


def _rates(text):
    rates = _list("rates")(text)
    for rate in rates:
        try:
            network.parse_rate(rate)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    # Fastest first: models are built and warmed up at the first rate of each method.
    return sorted(rates, key=network.parse_rate, reverse=True)


def _workers(text):
    try:
        workers = [int(item) for item in text.split(",")]
    except ValueError:
        workers = []
    if not workers or min(workers) < 2:
        raise argparse.ArgumentTypeError(f"--workers takes numbers >= 2 such as 2,4; got {text!r}")
    return workers


def add_arguments(parser):
    parser.add_argument(
        "--workers",
        type=_workers,
        default=list(DEFAULT_WORKERS),
        help="numbers of workers N (default 2,4)",
    )
    parser.add_argument(
        "--per-node",
        type=int,
        default=1,
        help="workers per node, L (default 1): each node a namespace whose workers talk "
        "unshaped, the links between nodes shaped; the two-level methods (-2l) need L > 1",
    )
    parser.add_argument(
        "--rates",
        type=_rates,
        default=list(DEFAULT_RATES),
        help="link rates, both directions (default 10G,1G,100M)",
    )
    parser.add_argument(
        "--models",
        type=_list("--models", MODELS),
        default=list(MODELS),
        help=f"models (default {','.join(MODELS)})",
    )
    parser.add_argument(
        "--methods",
        type=_list("--methods", METHODS),
        default=list(DEFAULT_METHODS),
        help=f"methods (default {','.join(DEFAULT_METHODS)})",
    )
    parser.add_argument(
        "--tf-methods",
        type=_list("--tf-methods", TF_METHODS),
        default=list(TF_METHODS),
        help=f"TensorFlow methods, in a job of their own (default {','.join(TF_METHODS)})",
    )
    parser.add_argument(
        "--no-tensorflow", action="store_true", help="skip the TensorFlow port's job"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per configuration (default: 10-30 for cnn, 3-7 for resnet50, as "
        f"many as take {STEP_BUDGET_SECONDS:g} s); one where the first takes "
        f"{LONG_SECONDS:g} s or more",
    )
    parser.add_argument(
        "--bare-repeats",
        type=int,
        default=2,
        help="replays of the bare collectives per configuration (default 2); one where the "
        f"first takes {LONG_SECONDS:g} s or more",
    )
    parser.add_argument(
        "--accuracy-methods",
        type=_list("--accuracy-methods", ACCURACY_CHOICES),
        default=list(ACCURACY_METHODS),
        help="methods of the MNIST-1D accuracy-against-time run, a codec meaning the codec "
        f"by its name alone (default {','.join(ACCURACY_METHODS)})",
    )
    # 2 workers: on 2 cores, 4 workers' accuracy runs took 11 of the matrix's 29 minutes.
    parser.add_argument("--accuracy-workers", type=int, default=2)
    parser.add_argument("--accuracy-rate", default="100M")
    parser.add_argument(
        "--accuracy-steps",
        type=int,
        default=3000,
        help="training steps of each accuracy run (default 3000: the demo's schedule, "
        "lr 0.1, heavy-ball momentum 0.9, cosine, global batch 100)",
    )
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy runs")
    parser.add_argument(
        "--no-op-counts",
        action="store_true",
        help="skip the counts of ops per step per codec, at each N: torch ops and host reads "
        "(benchmarks/op_count.py), TensorFlow ops (benchmarks/tf_op_count.py)",
    )
    parser.add_argument(
        "--localhost", action="store_true", help="run on localhost without namespaces or shaping"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1500,
        help="seconds per Horovod job, after which it is killed (default 1500), and "
        f"{ACCURACY_STEP_SECONDS} s more per step of each accuracy run",
    )
    parser.add_argument("--out", default=OUT, help=f"output directory (default {OUT})")
    parser.add_argument("--seed", type=int, default=0)


def _spec(args, rates):
    accuracy_rate = args.accuracy_rate if rates != [LOCALHOST] else LOCALHOST
    accuracy = {
        "workers": 0 if args.no_accuracy else args.accuracy_workers,
        "methods": [] if args.no_accuracy else args.accuracy_methods,
        "rate": accuracy_rate,
        "steps": args.accuracy_steps,
        "every": max(1, args.accuracy_steps // 10),
        "lr": 0.1,
    }
    return {
        "models": args.models,
        "methods": args.methods,
        "tf_methods": [] if args.no_tensorflow else args.tf_methods,
        "rates": rates,
        "per_node": args.per_node,
        "seed": args.seed,
        # Timed steps per model, at every rate alike.
        "steps": {m: [args.steps] * 2 if args.steps else timed_steps(m) for m in args.models},
        "bare_repeats": args.bare_repeats,
        "accuracy": accuracy,
    }


def _units(spec, workers):
    """Events that advance the progress bar in the jobs of ``workers`` workers."""
    # The bare replays at every rate; per method, its compute baseline and every rate.
    per_model = len(spec["rates"]) + len(spec["methods"]) * (1 + len(spec["rates"]))
    accuracy = len(spec["accuracy"]["methods"]) if workers == spec["accuracy"]["workers"] else 0
    tensorflow = len(spec["models"]) * len(spec["tf_methods"]) * (1 + len(spec["rates"]))
    return 1 + len(spec["models"]) * per_model + accuracy + tensorflow  # 1: the idle traffic


def run_jobs(hosts, spec, timeout, shape, progress, events):
    """The PyTorch job on ``hosts``, then the TensorFlow jobs of the spec's methods.
    The PyTorch job's accuracy runs, if it has them, get time of their own on top of
    ``timeout``."""
    accuracy = spec["accuracy"]
    if hosts.workers == accuracy["workers"]:
        timeout += len(accuracy["methods"]) * accuracy["steps"] * ACCURACY_STEP_SECONDS
    run_job(hosts, spec, timeout, shape, progress, events, "benchmarks.worker")
    for methods in tf_jobs(spec["tf_methods"]):
        job_spec = {**spec, "tf_methods": methods}
        run_job(hosts, job_spec, timeout, shape, progress, events, "benchmarks.tf_worker")


def tf_jobs(methods):
    """The TensorFlow ``methods`` of each job: an adaptive one alone (it holds its codec
    forced beside it, and a new model at every rate), the others ``TF_METHODS_PER_JOB`` at
    a time. A TensorFlow worker keeps much of every model, state and traced graph it made
    (about 0.8 GB a method at the 25M model): four workers that ran seven of the eight
    methods in one job outgrew the 24 GiB of this project's machines."""
    jobs, fixed = [], []
    for method in methods:
        if method.endswith(AUTO_SUFFIX):
            jobs.append([method])
            continue
        fixed.append(method)
        if len(fixed) == TF_METHODS_PER_JOB:
            jobs.append(fixed)
            fixed = []
    return jobs + [fixed] if fixed else jobs


def run_job(hosts, spec, timeout, shape, progress, events, program):
    """Runs one benchmark job of ``program`` (a worker module) on ``hosts``;
    ``shape(rate)`` sets the links' rate."""
    with tempfile.TemporaryDirectory(prefix="hvdc-bench-") as workdir:
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        log_path = os.path.join(workdir, "workers.log")
        # One job runs every method and replays each one's collectives under new names, so
        # it meets several times the ~500 names of a training job: with Horovod's default
        # response cache of 1024 names the later methods paid for evictions (a full
        # negotiation through rank 0) that training alone would not.
        env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout)), "HOROVOD_CACHE_CAPACITY": "16384"}
        with (
            open(log_path, "w") as log,
            hosts.job([sys.executable, "-m", program, spec_path], env, log) as job,
        ):
            outcome = {}
            monitor = threading.Thread(target=_wait, args=(job, timeout, outcome), daemon=True)
            monitor.start()
            done = False
            for line in job.output:
                event = event_of(line)
                if event is None:
                    log.write(line)
                    continue
                if event["kind"] == "shape":
                    shape(event["rate"])
                    open(shaped_path(workdir, event["reply"]), "w").close()
                    continue
                done = event["kind"] == "done"
                events.append(event)
                progress.set_postfix_str(_describe(event), refresh=False)
                progress.update(0 if done else 1)
            monitor.join()
        if "error" in outcome or outcome.get("code") or not done:
            tail = _tail(log_path)
            reason = outcome.get("error") or f"exit code {outcome.get('code')}"
            raise RuntimeError(
                f"benchmark job {program} on {hosts.workers} workers failed ({reason}); "
                f"worker output:\n{tail}"
            )


def op_counts(model, codecs, workers, timeout, tensorflow=False):
    """``benchmarks.op_count`` of ``codecs`` on ``model`` on each of ``OP_COUNT_PATHS`` (the CPU
    kernels, the device path that CUDA tensors take, interpreted on CPU, and the eager
    ops), or with ``tensorflow`` ``benchmarks.tf_op_count`` on each of ``TF_OP_COUNT_PATHS``
    (the XLA-compiled calls that GPU tensors take, compiled for the CPU, the uncompiled ops
    and the CPU kernels), in a job of ``workers`` on localhost (the counts do not depend on
    the link); TensorFlow's in a job per path: its workers keep what every traced model took,
    and three paths' worth of the 25M model at N = 4 outgrew 24 GiB. Started as the
    benchmark's own jobs are: ``horovodrun`` would first import TensorFlow to check how
    Horovod was built."""
    program, paths, env = (
        ("benchmarks.tf_op_count", TF_OP_COUNT_PATHS, {})
        if tensorflow
        else ("benchmarks.op_count", OP_COUNT_PATHS, {"TRITON_INTERPRET": "1"})
    )
    jobs = [[path] for path in paths] if tensorflow else [list(paths)]
    counts = []
    for job_paths in jobs:
        with tempfile.TemporaryDirectory(prefix="hvdc-ops-") as workdir:
            out = os.path.join(workdir, "ops.json")
            log_path = os.path.join(workdir, "workers.log")
            command = [sys.executable, "-m", program, "--model", model]
            command += ["--codecs", ",".join(codecs), "--out", out]
            command += ["--paths", ",".join(job_paths)]
            with open(log_path, "w") as log:
                job = HorovodJob(LocalHosts(workers), command, env=env, log=log)
                code = job.run(timeout * len(job_paths))  # each path's share of the job
            if code:
                raise RuntimeError(
                    f"the op count job ({', '.join(job_paths)}) failed (exit code {code}); "
                    f"output:\n{_tail(log_path)}"
                )
            with open(out) as f:
                counts += json.load(f)
    return counts


def _op_counts(args, codecs, tensorflow=False):
    """``op_counts`` of every model of ``args`` at each of its N, by model."""
    return {
        model: [
            counts
            for n in args.workers
            for counts in op_counts(model, codecs, n, args.timeout, tensorflow)
        ]
        for model in args.models
    }


def _tail(log_path):
    """The end of a job's log, for its error."""
    with open(log_path) as f:
        return f.read()[-4000:]


def _wait(job, timeout, outcome):
    try:
        outcome["code"] = job.wait(timeout)
    except TimeoutError as error:
        outcome["error"] = str(error)


def _describe(event):
    return " ".join(
        str(event[key])
        for key in ("workers", "model", "method", "exchange", "rate")
        if key in event
    )


def _machine():
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {
        "cpus": os.cpu_count(),
        "load_average_1_5_15": [float(x) for x in load],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _local_hosts(workers, per_node):
    """Workers on this machine's loopback: on one host, or placed on named nodes of
    ``per_node`` (Horovod's local and cross ranks as on a cluster)."""
    if per_node == 1:
        return LocalHosts(workers)
    nodes = workers // per_node
    return LocalHosts(workers, ",".join(f"node{k}:{per_node}" for k in range(nodes)))


@contextlib.contextmanager
def _namespaced_hosts(net):
    """The hosts of ``net`` (an entered ``TestNetwork``): nodes of several workers are
    hosts that horovodrun reaches over ssh, so that Horovod places the ranks and derives
    their local and cross ranks itself; a node of one worker has none to derive."""
    if net.per_node == 1:
        yield NamespacedHosts(net)
        return
    with ssh_hosts.SshHosts(net) as reachable:
        yield SshLaunchedHosts(reachable)


def bench(args):
    for workers in args.workers:
        network.check_topology(workers, args.per_node)
    reason = "--localhost given" if args.localhost else network.unavailable_reason()
    rates = args.rates if reason is None else [LOCALHOST]
    if reason is not None:
        print(
            f"bench: network namespaces unavailable ({reason}); falling back to localhost: "
            f"links are NOT shaped and interface counters are not recorded",
            flush=True,
        )
    spec = _spec(args, rates)
    events = []
    # The output directory as the user gave it, relative to the checkout when it is inside:
    # results are committed, and a machine's absolute paths have no place in them.
    arguments = dict(
        vars(args),
        out=os.path.relpath(args.out, REPO)
        if os.path.abspath(args.out).startswith(REPO + os.sep)
        else args.out,
    )
    result = {
        "arguments": arguments,
        "network": (
            ("namespaces, tc tbf" if reason is None else f"localhost ({reason})")
            + (f"; {args.per_node} workers per node, unshaped inside" if args.per_node > 1 else "")
        ),
        "machine": {"before": _machine()},
        "spec": spec,
        "events": events,
    }
    total = sum(_units(spec, n) for n in args.workers)
    try:
        with tqdm(total=total, unit="run", dynamic_ncols=True) as progress:
            for workers in args.workers:
                if reason is None:
                    with (
                        network.TestNetwork(workers, args.per_node) as net,
                        _namespaced_hosts(net) as hosts,
                    ):
                        run_jobs(hosts, spec, args.timeout, net.shape, progress, events)
                else:
                    hosts = _local_hosts(workers, args.per_node)
                    run_jobs(hosts, spec, args.timeout, lambda rate: None, progress, events)
                write(result, args.out)
        codecs = [m for m in args.methods if m in CODEC_METHODS and not m.endswith(AUTO_SUFFIX)]
        if codecs and not args.no_op_counts:
            result["op_counts"] = _op_counts(args, codecs)
        tf_codecs = [m[len(TF_PREFIX) :] for m in args.tf_methods]
        tf_codecs = [m for m in tf_codecs if m in CODEC_METHODS and not m.endswith(AUTO_SUFFIX)]
        if tf_codecs and not (args.no_op_counts or args.no_tensorflow):
            result["tf_op_counts"] = _op_counts(args, tf_codecs, tensorflow=True)
    finally:
        # Also after a failed job: a long matrix keeps what it measured.
        tables = write(result, args.out)
    print(tables)
    for path in plots.write_all(result, args.out):
        print(f"wrote {os.path.relpath(path)}")
    return result


def write(result, out):
    """Writes ``bench.json`` and ``bench.md`` (returned) of the events so far."""
    result["machine"]["after"] = _machine()
    result["rows"] = report.rows(result["events"], result["spec"]["per_node"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    tables = report.markdown(result)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(tables)
    return tables


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hvd-compress bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return bench(parser.parse_args(argv))


if __name__ == "__main__":
    main()
