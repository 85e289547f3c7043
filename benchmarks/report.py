"""From the workers' raw measurements to the benchmark's rows and Markdown tables.

Per model, N, link rate and method (one row):

- ``communication`` = step - compute: everything the exchange adds to a step (encode,
  collectives, decode), with ``compute`` the same step with no exchange at all: the median
  of the baselines measured in the same job before each method's steps. One baseline per
  method moved with the slot it ran in: at N = 4 the one after qsgd-inf's run read 0.78 and
  0.81 s in two runs, 0.24-0.35 s the others; a single one per N once read 1,128 ms.
- ``codec`` (hvd_compress codecs only) = mean step - compute - mean time blocked in
  ``hvd_compress.pt.exchange.wait``: the codec's own work (scales, random draws, encode,
  pack, unpack, decode, the server's second compression) on the main thread. Means on both
  sides: the blocked time is only known as a total, and a median step against a mean wait
  goes negative when a few slow steps (CPU contention) carry most of the waiting.
- ``predicted`` = compute + codec + sent x 8 / rate: the cost model's step time, with
  ``sent`` the bytes ``hvd_compress.cost`` says a worker puts on the network.
- ``wire_over_sent``: bytes the worker's interface transmitted per step over ``sent``; and
  ``unexplained``, the same after removing Horovod's control messages (the idle rate the
  interface showed before the measurements, times the step time).
- ``auto``: for a codec's ``-auto`` method, its step over the fastest step among
  ``AUTO_RIVALS`` and the codec forced on every tensor, measured in the same run (the
  TensorFlow port's codec forced in turns with the adaptive mode's steps)
  (``auto_over_fastest``, at most ``AUTO_BOUND`` where the adaptive mode does its job), with
  the paths it chose and the exchange seconds its model predicted for them and for every
  tensor on each path.
- ``comm_speedup`` = communication of ``hvd-none`` / communication of the method, against
  ``ceiling`` = Horovod's bare fp32 allreduce of the gradients / the method's own
  collectives replayed bare (same sizes, no encode or decode): ``of_ceiling`` is the
  fraction of the bare collectives' speed-up the method reaches.

The TensorFlow port's rows (``tf-`` methods, ``benchmarks.tf_worker``) are measured against
their own port: their compute is the TensorFlow step without exchange, their speed-ups are
over ``tf-hvd-none`` and ``tf-hvd-fp16``, and their bare collectives are those the PyTorch
job replayed for the same codec (both ports hand Horovod the same bytes, tensor by tensor).
``of_pytorch`` is a TensorFlow row's speed-up over the PyTorch port's, for the same codec.

On nodes of several workers (``bench --per-node L``) the interfaces are the nodes' links,
each shared by the node's L workers: ``wire_tx`` is one node's bytes to the other nodes;
``predicted``, ``wire_over_sent`` and ``unexplained`` are left out (the cost model of one
tier would charge the unshaped traffic inside a node at the link's rate). A two-level
method's row (``<codec>-2l``) sits beside its codec's flat exchange: the step and the node
link's bytes of each, and their ratios.
"""

import collections
import statistics

from .network import parse_rate
from .protocol import AUTO_SUFFIX, NODE_AVERAGE, TF_PREFIX, TWO_LEVEL_SUFFIX

BASELINE, FP16_BASELINE = "hvd-none", "hvd-fp16"
# Horovod's own exchanges are exactly these bare collectives.
HOROVOD_BARE = {BASELINE: "fp32 allreduce", FP16_BASELINE: "fp16 allreduce"}
# What a codec's adaptive mode must keep up with: the uncompressed exchanges of Horovod and
# DDP, and the same codec forced on every tensor.
AUTO_RIVALS = ("hvd-none", "hvd-fp16", "ddp", "ddp-fp16")
AUTO_BOUND = 1.05


def _rate_bits(rate):
    try:
        return parse_rate(rate)
    except ValueError:
        return None  # localhost: unshaped


def _ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def _port(method):
    """The prefix of ``method``'s port: ``TF_PREFIX`` for TensorFlow's, "" for PyTorch's."""
    return TF_PREFIX if method.startswith(TF_PREFIX) else ""


def rows(events, per_node=1):
    """The rows of a run's ``events``, measured on nodes of ``per_node`` workers."""
    baselines = collections.defaultdict(list)
    for e in events:
        if e["kind"] == "compute":
            baselines[e["workers"], e["model"], _port(e["method"])].append(e["seconds"])
    compute = {key: statistics.median(seconds) for key, seconds in baselines.items()}
    idle = {e["workers"]: e["tx_per_second"] for e in events if e["kind"] == "idle"}
    bare = {
        (e["workers"], e["model"], e["rate"]): e["exchanges"] for e in events if e["kind"] == "bare"
    }
    steps = {
        (e["workers"], e["model"], e["rate"], e["method"]): e for e in events if e["kind"] == "step"
    }
    result = []
    for (workers, model, rate, method), e in steps.items():
        port = _port(method)
        twin = method[len(port) :]  # the PyTorch method of a TensorFlow one
        c = compute[workers, model, port]
        bits = _rate_bits(rate)
        codec = (
            statistics.fmean(e["step_seconds"]) - c - e["wait_seconds"]
            if "wait_seconds" in e
            else None
        )
        base = steps.get((workers, model, rate, port + BASELINE))
        fp16 = steps.get((workers, model, rate, port + FP16_BASELINE))
        exchanges = bare.get((workers, model, rate), {})
        own_bare = steps.get((workers, model, rate, twin), {}).get(
            "bare_seconds", exchanges.get(HOROVOD_BARE.get(twin), {}).get("seconds")
        )
        control = idle[workers] * e["seconds"] if idle.get(workers) is not None else None
        row = {
            "workers": workers,
            "model": model,
            "rate": rate,
            "method": method,
            "seconds": e["seconds"],
            "compute": c,
            "communication": e["seconds"] - c,
            "codec": codec,
            "wait": e.get("wait_seconds"),
            "handed": e["handed"],
            "sent": e["sent"],
            "wire_tx": e["wire_tx"],
            "wire_over_sent": _ratio(e["wire_tx"], e["sent"]) if per_node == 1 else None,
            "control": control,
            "unexplained": _ratio(e["wire_tx"] - control, e["sent"]) - 1
            if control is not None and per_node == 1
            else None,
            "predicted": c + (codec or 0.0) + e["sent"] * 8 / bits
            if bits and per_node == 1
            else None,
            "speedup": _ratio(base and base["seconds"], e["seconds"]),
            "speedup_fp16": _ratio(fp16 and fp16["seconds"], e["seconds"]),
            "comm_speedup": _ratio(base and base["seconds"] - c, e["seconds"] - c),
            "ceiling": _ratio(exchanges.get("fp32 allreduce", {}).get("seconds"), own_bare),
            "bare": own_bare,
        }
        row["of_ceiling"] = _ratio(row["comm_speedup"], row["ceiling"])
        if port:
            torch_base = steps.get((workers, model, rate, BASELINE))
            torch_twin = steps.get((workers, model, rate, twin))
            row["of_pytorch"] = _ratio(
                row["speedup"],
                _ratio(torch_base and torch_base["seconds"], torch_twin and torch_twin["seconds"]),
            )
        if method.endswith(AUTO_SUFFIX):
            codec = method[: -len(AUTO_SUFFIX)]
            rivals = {
                m: steps[workers, model, rate, m]["seconds"]
                for m in tuple(port + r for r in AUTO_RIVALS) + (codec,)
                if (workers, model, rate, m) in steps
            }
            if e.get("forced_step_seconds"):
                # The codec forced in turns with the adaptive mode's steps, in place of its
                # own row, measured minutes apart.
                rivals[codec] = statistics.median(e["forced_step_seconds"])
            fastest = min(rivals, key=rivals.get) if rivals else None
            row["auto"] = {
                "fastest": fastest,
                "adaptive": e.get("adaptive"),
                "over_fastest": _ratio(e["seconds"], rivals.get(fastest)),
            }
        result.append(row)
    return result


def _trials(decision):
    """The trials' outcomes: the decision's (against the paths it replaced), then its
    challenger's (every tensor on one path, against the paths in force before it), each
    with its median timed steps and the turns a side that timed them."""

    def seconds(trial):
        turns = trial["turns"]
        return f"({_ms(trial['seconds'])} vs {_ms(trial['replaced_seconds'])}, {turns} turns)"

    outcomes = []
    trial, challenge = decision.get("trial"), decision.get("challenge")
    if trial is not None:
        outcomes.append(f"{'kept' if trial['kept'] else 'reverted'} {seconds(trial)}")
    if challenge is not None:
        verdict = "stood" if challenge["kept"] else "fell"
        outcomes.append(f"all {decision['challenger']} {verdict} {seconds(challenge)}")
    return "; ".join(outcomes) or "-"


def _auto_table(rows):
    lines = []
    for r in rows:
        auto = r.get("auto")
        if auto is None:
            continue
        decision = auto["adaptive"] or {}
        predicted = decision.get("predicted_seconds", {})
        counts = decision.get("counts", {})
        ratio = auto["over_fastest"]
        lines.append(
            [
                r["workers"],
                r["rate"],
                r["method"],
                _ms(r["seconds"]),
                auto["fastest"] or "-",
                _x(ratio),
                "yes" if ratio is not None and ratio <= AUTO_BOUND else "no",
                " ".join(f"{p} {counts[p]}" for p in sorted(counts)) or "-",
                " / ".join(_ms(predicted.get(p)) for p in ("chosen", "codec", "fp16", "fp32")),
                _trials(decision),
            ]
        )
    return (
        _table(
            [
                "N",
                "rate",
                "method",
                "step",
                "fastest other",
                "over fastest",
                f"within {AUTO_BOUND}x",
                "tensors by path",
                "predicted exchange: chosen / codec / fp16 / fp32",
                "trial: tried vs replaced (ms)",
            ],
            lines,
        )
        if lines
        else None
    )


def _beside(rows, twin_of):
    """(row, twin) for each row whose ``twin_of(row)`` names another method: the row of
    that method at the same N and rate, or None if it was not measured."""
    by_method = {(r["workers"], r["rate"], r["method"]): r for r in rows}
    for r in rows:
        twin = twin_of(r)
        if twin is not None:
            yield r, by_method.get((r["workers"], r["rate"], twin))


def _flat_twin(row):
    method = row["method"]
    return method[: -len(TWO_LEVEL_SUFFIX)] if method.endswith(TWO_LEVEL_SUFFIX) else None


def _pytorch_twin(row):
    return row["method"][len(TF_PREFIX) :] if "of_pytorch" in row else None


def _two_level_table(rows):
    """Each two-level row beside its codec's flat exchange."""
    lines = []
    for r, f in _beside(rows, _flat_twin):
        if f is None:
            continue
        lines.append(
            [
                r["workers"],
                r["rate"],
                f["method"],
                _ms(f["seconds"]),
                _ms(r["seconds"]),
                _x(_ratio(r["seconds"], f["seconds"])),
                _mb(f["wire_tx"]),
                _mb(r["wire_tx"]),
                _x(_ratio(r["wire_tx"], f["wire_tx"])),
            ]
        )
    if not lines:
        return None
    return _table(
        [
            "N",
            "rate",
            "codec",
            "flat step",
            "two-level step",
            "step ratio",
            "flat node link tx (MB)",
            "two-level node link tx (MB)",
            "bytes ratio",
        ],
        lines,
    )


def _port_table(rows):
    """Each TensorFlow row beside its PyTorch twin's step and speed-up."""
    lines = []
    for r, twin in _beside(rows, _pytorch_twin):
        twin = twin or {}
        lines.append(
            [
                r["workers"],
                r["rate"],
                r["method"],
                _ms(r["compute"]),
                _ms(r["seconds"]),
                _ms(twin.get("seconds")),
                _x(r["speedup"]),
                _x(twin.get("speedup")),
                _x(r["of_pytorch"]),
                _x(r["of_ceiling"]),
            ]
        )
    header = [
        "N",
        "rate",
        "method",
        "compute",
        "step",
        "PyTorch step",
        "speed-up (vs tf-hvd-none)",
        "PyTorch speed-up",
        "of PyTorch's",
        "of bare",
    ]
    return _table(header, lines) if lines else None


def _ms(seconds):
    return (
        "-"
        if seconds is None
        else f"{1000 * seconds:,.0f}"
        if seconds >= 0.1
        else f"{1000 * seconds:.1f}"
    )


def _mb(nbytes):
    return "-" if nbytes is None else f"{nbytes / 1e6:,.2f}"


def _x(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def _pct(fraction):
    return "-" if fraction is None else f"{100 * fraction:+.1f}%"


def _op_count_table(model, counts, tensorflow=False):
    """The Markdown lines of one ``benchmarks.op_count`` result, or with ``tensorflow`` one
    of ``benchmarks.tf_op_count`` (ops of the traced step, which has no host reads to count:
    its graph runs whole, and the op types each codec adds most of instead)."""
    what = (
        "TensorFlow ops of one traced step"
        if tensorflow
        else "top-level torch ops and host reads of one step"
    )
    baseline = f"none: {counts['none']:,} ops"
    if not tensorflow:
        baseline += f", {counts['none_host_reads']} reads"
    path = f", {counts['path']}" if "path" in counts else ""
    title = f"\n### {model}: {what} (N = {counts['world_size']}{path}; {baseline})\n"
    header = [
        "codec",
        "ops",
        "added by compression",
        "added per tensor",
        "compressed tensors",
        "added per compressed tensor",
        "most added" if tensorflow else "added host reads",
    ]
    lines = [
        [
            c["codec"],
            f"{c['ops']:,}",
            f"{c['added']:,}",
            f"{c['added_per_tensor']:.1f} (of {c['tensors']})",
            c["compressed_tensors"],
            "-"
            if c["added_per_compressed_tensor"] is None
            else f"{c['added_per_compressed_tensor']:.1f}",
            ", ".join(f"{op} {n:,}" for op, n in c["added_by_type"].items())
            if tensorflow
            else c["added_host_reads"],
        ]
        for c in counts["codecs"]
    ]
    return [title, _table(header, lines)]


def _table(header, lines):
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(map(str, line)) + " |" for line in lines]
    )


def _order(rows):
    return sorted(rows, key=lambda r: (r["model"], r["workers"], -(_rate_bits(r["rate"]) or 0)))


def markdown(result):
    """The tables of the README: times, bytes, ceilings, bare collectives, accuracy."""
    rows = _order(result["rows"])
    machine = result["machine"]
    parts = [
        f"Network: {result['network']}; {machine['before']['cpus']} CPUs, load average "
        f"(1, 5, 15 min) {machine['before']['load_average_1_5_15']} before and "
        f"{machine['after']['load_average_1_5_15']} after, {machine['before']['date']}."
    ]
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        parts.append(f"\n### {model}: step time (ms) and speed-up\n")
        parts.append(
            _table(
                [
                    "N",
                    "rate",
                    "method",
                    "step",
                    "predicted",
                    "compute",
                    "communication",
                    "codec",
                    "vs hvd-none",
                    "vs hvd-fp16",
                ],
                [
                    [
                        r["workers"],
                        r["rate"],
                        r["method"],
                        _ms(r["seconds"]),
                        _ms(r["predicted"]),
                        _ms(r["compute"]),
                        _ms(r["communication"]),
                        _ms(r["codec"]),
                        _x(r["speedup"]),
                        _x(r["speedup_fp16"]),
                    ]
                    for r in mine
                ],
            )
        )
        parts.append(f"\n### {model}: bytes per worker per step (MB)\n")
        parts.append(
            _table(
                [
                    "N",
                    "rate",
                    "method",
                    "handed",
                    "sent (cost model)",
                    "wire tx",
                    "wire / sent",
                    "control msgs",
                    "unexplained",
                ],
                [
                    [
                        r["workers"],
                        r["rate"],
                        r["method"],
                        _mb(r["handed"]),
                        _mb(r["sent"]),
                        _mb(r["wire_tx"]),
                        _x(r["wire_over_sent"]),
                        _mb(r["control"]),
                        _pct(r["unexplained"]),
                    ]
                    for r in mine
                ],
            )
        )
        parts.append(f"\n### {model}: exchange speed-up against the bare collectives\n")
        parts.append(
            _table(
                [
                    "N",
                    "rate",
                    "method",
                    "communication",
                    "bare collectives",
                    "speed-up",
                    "bare speed-up",
                    "of bare",
                ],
                [
                    [
                        r["workers"],
                        r["rate"],
                        r["method"],
                        _ms(r["communication"]),
                        _ms(r["bare"]),
                        _x(r["comm_speedup"]),
                        _x(r["ceiling"]),
                        _x(r["of_ceiling"]),
                    ]
                    for r in mine
                    if r["ceiling"] is not None
                ],
            )
        )
        levels = _two_level_table(mine)
        if levels:
            parts.append(f"\n### {model}: the two-level exchange against the flat one\n")
            parts.append(levels)
        ports = _port_table(mine)
        if ports:
            parts.append(f"\n### {model}: the TensorFlow port against PyTorch's\n")
            parts.append(ports)
        auto = _auto_table(mine)
        if auto:
            parts.append(f"\n### {model}: the adaptive mode against the fastest fixed choice\n")
            parts.append(auto)
    for model, by_world in sorted(result.get("op_counts", {}).items()):
        for counts in by_world:
            parts += _op_count_table(model, counts)
    for model, by_world in sorted(result.get("tf_op_counts", {}).items()):
        for counts in by_world:
            parts += _op_count_table(model, counts, tensorflow=True)
    bare = [e for e in result["events"] if e["kind"] == "bare"]
    if bare:
        parts.append("\n### Horovod's bare collectives (whole model, no encode or decode)\n")
        lines = []
        for e in sorted(
            bare, key=lambda e: (e["model"], e["workers"], -(_rate_bits(e["rate"]) or 0))
        ):
            fp32 = e["exchanges"]["fp32 allreduce"]["seconds"]
            bits = _rate_bits(e["rate"])
            for name, m in e["exchanges"].items():
                throughput = m["sent"] * 8 / m["seconds"]
                lines.append(
                    [
                        e["model"],
                        e["workers"],
                        e["rate"],
                        name,
                        _mb(m["sent"]),
                        _ms(m["seconds"]),
                        f"{throughput / 1e6:,.0f}",
                        f"{100 * throughput / bits:.0f}%" if bits and name != NODE_AVERAGE else "-",
                        _x(fp32 / m["seconds"]),
                    ]
                )
        parts.append(
            _table(
                ["model", "N", "rate", "exchange", "sent MB", "ms", "Mbit/s", "of link", "vs fp32"],
                lines,
            )
        )
    curves = [e for e in result["events"] if e["kind"] == "accuracy"]
    if curves:
        e0 = curves[0]
        parts.append(
            f"\n### MNIST-1D CNN: test accuracy against training time "
            f"(N = {e0['workers']}, {e0['rate']}, {e0['points'][-1][1]} steps)\n"
        )
        final = {e["method"]: e["points"][-1][2] for e in curves}
        baseline = final.get("hvd-none")
        parts.append(
            _table(
                ["method", "final accuracy", "vs hvd-none", "training time (s)", "best accuracy"],
                [
                    [
                        e["method"],
                        f"{100 * final[e['method']]:.1f}%",
                        "-"
                        if baseline is None
                        else f"{100 * (final[e['method']] - baseline):+.1f}",
                        f"{e['points'][-1][0]:.1f}",
                        f"{100 * max(p[2] for p in e['points']):.1f}%",
                    ]
                    for e in curves
                ],
            )
        )
    return "\n".join(parts) + "\n"
