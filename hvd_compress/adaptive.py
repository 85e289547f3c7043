"""``adaptive``: every tensor goes the fastest way, chosen from a timeline of the step.

On a fast link a plain allreduce often beats any codec (Agarwal et al., "On the utility of
gradient compression in distributed training systems", MLSys 2022): the codec's passes over
the gradient cost more than the bytes they save, and the uncompressed exchange hides behind
the backward pass anyway. Like Espresso (Wang et al., EuroSys 2023), the adaptive mode
chooses per tensor among three paths from a model of the step's timeline:

``codec``  the chosen codec through its exchange (``TensorPlan.exchange``),
``fp16``   a half-precision allreduce (Horovod's ``Compression.fp16``),
``fp32``   Horovod's plain allreduce.

The model is fed with quantities measured on the running job, never with constants:

- the backward timeline: when each gradient became ready, relative to the first;
- each tensor's codec CPU time before its collective (compensation, scale, encoding,
  packing) and after (unpacking, summing, decoding, the server's work), timed on the thread
  that runs it during the warm-up steps, when every tensor goes through the codec: the
  least of those steps, since a worker's first steps also pay for its heap's growth;
- the fp16 casts' CPU time on each tensor;
- the link, per carrier: latency and seconds per byte of an fp32 allreduce, an fp16
  allreduce and a byte allgather (what packed codes travel by), fitted to timed probes of
  a small and a large size. The carriers differ by more than their bytes: Horovod sums
  fp16 on the CPU far slower than fp32, and an allgather sums nothing.

CPU times are multiplied by ``contention``: the wall time over the CPU time of the work
before the collectives (which never waits for the network), at least 1, the median of the
steps measured since the warm-up began. With more ranks
than cores on a host, a CPU second of one rank costs more than a second of its step.

The timeline (``simulate``): the gradients become ready in backward order; a path's work
before its collective runs on the backward's thread, so it delays every later gradient; the
collectives share one link in order, each taking its carrier's time for the bytes
``hvd_compress.cost`` counts as sent, and one latency per dependent round of messages when
it finds the link idle (queued behind others, Horovod fuses it into their traffic and its
round trips overlap their transfer); the work after a collective runs in ``synchronize``,
tensor by tensor, once its collective is done and the backward pass is over.
The step's exchange time is when the last tensor is decoded, past the end of the backward.

Every rank takes the same decisions: the measurements are Max-allreduced before the model
runs, and the model is a deterministic function of them.

A decision that changes paths is then tried against the paths it would replace
(``hvd_compress.trial``), and stands only if its steps are measured faster. The model can
be wrong where its probes are: a probe runs alone on a quiet link, while the step's
collectives share the CPU with the backward pass of every rank on the host, which with more
ranks than cores makes an uncompressed allreduce far slower than its probe predicts. The
trial makes "never slower than the paths in force" a measurement rather than a forecast.
A decision that keeps the paths in force, or whose trial fell, is challenged: the fastest
single path that differs from the paths in force and from the decision's (every tensor by
the codec, fp16 or fp32), if predicted within ``CHALLENGE_MARGIN`` of the decision, is tried
the same way. So a model wrong in either direction costs at most two trials per decision,
and where the model's choice and the paths in force both lose to a third path, that path is
found.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence

from . import cost
from .trial import TRIAL_STEPS, TRIAL_TURNS, Trial, trial_turns, trial_verdict
from .validation import check_float, check_int

PATHS = ("codec", "fp16", "fp32")

# On equal predicted times the simpler path wins: fewer passes over memory, no rounding.
_PREFERENCE = {"fp32": 0, "fp16": 1, "codec": 2}
# A decision that keeps the paths in force, or whose trial fell, is challenged by the fastest
# single path predicted at most this many times its exchange: with more ranks than cores the
# model errs by about that factor (docs/adaptive.md), and the bound keeps a challenge's cost
# below one more exchange per step for half of a trial's steps.
CHALLENGE_MARGIN = 2.0


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Options of the adaptive mode (``DistributedOptimizer(adaptive=...)``).

    Args:
        warmup_steps: steps at the start (and after a change of world) in which every
            compressible tensor goes through the codec while its CPU time and the backward
            timeline are measured; the first decision follows them. At least 1. Default 5:
            a worker's heap grows for its first three steps, which pay for fresh pages.
        every: re-probe the link and decide again every this many steps after the first
            decision (the codec times of the warm-up are kept). 0 decides once (and tries
            it) and never switches again. Default 1000: a decision probes
            three carriers, about a second on a fast link.
        pin: parameter names mapped to the path they always take (``"codec"``, ``"fp16"``
            or ``"fp32"``), whatever the model predicts. ``"codec"`` only for tensors the
            codec compresses.
        trial_seconds: how long an undecided trial of a decision may go on: its two sides
            take at most as many turns as the steps measured before the decision (their
            exchange windows) fill in this many seconds, at least ``trial.TRIAL_TURNS`` a
            side and at most ``trial.MAX_TRIAL_TURNS`` (``trial.trial_turns``); 0 for the
            least. A trial that decides sooner ends sooner, and one that goes on has sides that step
            alike, so the length costs little. Default 60.0: steps of 1 s may take 15
            turns a side, steps of 0.6 s and less the most.
    """

    warmup_steps: int = 5
    every: int = 1000
    pin: Mapping[str, str] = dataclasses.field(default_factory=dict)
    trial_seconds: float = 60.0

    def __post_init__(self):
        check_int("Adaptive", "warmup_steps", self.warmup_steps, low=1)
        check_int("Adaptive", "every", self.every, low=0)
        check_float("Adaptive", "trial_seconds", self.trial_seconds, low=0.0)
        bad = {name: path for name, path in dict(self.pin).items() if path not in PATHS}
        if bad:
            raise ValueError(f"Adaptive: pin maps parameter names to one of {PATHS}; got {bad}")
        object.__setattr__(self, "pin", dict(self.pin))

    def __hash__(self):
        # Hashable despite its dict, so that equal options find one pipeline (the tape's).
        return hash(
            (self.warmup_steps, self.every, tuple(sorted(self.pin.items())), self.trial_seconds)
        )

    @classmethod
    def of(cls, adaptive: bool | Adaptive | None) -> Adaptive | None:
        """The options a wrapper's ``adaptive`` argument asks for; None when off."""
        if adaptive is None or adaptive is False:
            return None
        if adaptive is True:
            return cls()
        if isinstance(adaptive, cls):
            return adaptive
        raise TypeError(
            f"adaptive must be True, False or an hvd_compress.Adaptive, got {adaptive!r}"
        )


def check_pipeline(codec, exchange: str) -> None:
    """Refuses a pipeline whose tensors the adaptive mode cannot move between paths: a
    two-level exchange (the mode chooses between a flat exchange and allreduces) and the
    codecs that select what they send from their memory."""
    if exchange == cost.TWO_LEVEL:
        raise ValueError(
            "adaptive: the adaptive mode chooses between a flat exchange and "
            "allreduces; it does not take exchange='two-level'"
        )
    if codec.sparse:
        raise ValueError(
            f"adaptive: {codec.name} selects what it sends from its "
            f"memory; the adaptive mode takes the dense codecs"
        )


# What a path's collectives carry, each with its own ``Link``: (dtype, collective) of the
# probes that measure it.
CARRIERS = {
    "fp32": ("float32", "allreduce"),
    "fp16": ("float16", "allreduce"),
    "bytes": ("uint8", "allgather"),
}
# Probe sizes in bytes: the small one measures the latency; the large one grows from
# PROBE_START by PROBE_GROWTH while it takes less than PROBE_SECONDS, up to PROBE_LARGEST,
# so that a fast link is measured at sizes where its bandwidth, not its latency, shows.
PROBE_SMALL = 4 << 10
PROBE_START, PROBE_GROWTH, PROBE_LARGEST = 1 << 20, 4, 16 << 20
PROBE_SECONDS = 0.02


def probe_sent(carrier: str, nbytes: int, world_size: int) -> float:
    """Bytes a worker sends in a probe of ``nbytes`` on ``carrier``."""
    if CARRIERS[carrier][1] == "allgather":
        return float((world_size - 1) * nbytes)
    return cost.allreduce_traffic(nbytes, world_size).sent


def next_probe(nbytes: int, seconds: float) -> int | None:
    """The large probe's next size after one of ``nbytes`` took ``seconds`` (agreed by
    every rank), or None when it is large enough."""
    if seconds >= PROBE_SECONDS or nbytes * PROBE_GROWTH > PROBE_LARGEST:
        return None
    return nbytes * PROBE_GROWTH


@dataclasses.dataclass(frozen=True)
class Link:
    """One collective's time on a carrier: ``latency`` seconds per dependent round of
    messages plus ``seconds_per_byte`` for each byte a worker sends."""

    latency: float
    seconds_per_byte: float

    @classmethod
    def fit(cls, small: tuple[float, float], large: tuple[float, float]) -> Link:
        """The line through two probes, each (bytes sent, seconds); never negative."""
        (b0, t0), (b1, t1) = small, large
        per_byte = max((t1 - t0) / (b1 - b0), 0.0) if b1 > b0 else 0.0
        return cls(max(t0 - per_byte * b0, 0.0), per_byte)


def fit_links(
    probe: Callable[[list[tuple[str, int]]], list[float]], world_size: int
) -> dict[str, Link]:
    """Every carrier's ``Link``, fitted to a small and a large probe collective; the large
    one grows (``next_probe``) until the link's bandwidth shows. ``probe`` times a list of
    (carrier, nbytes) collectives, each the slowest rank's, so that every rank grows and
    fits alike."""
    small = dict(zip(CARRIERS, probe([(carrier, PROBE_SMALL) for carrier in CARRIERS])))
    sizes = dict.fromkeys(CARRIERS, PROBE_START)
    large: dict[str, float] = {}
    growing = list(CARRIERS)
    while growing:
        seconds = probe([(carrier, sizes[carrier]) for carrier in growing])
        large.update(zip(growing, seconds))
        grown = {carrier: next_probe(sizes[carrier], large[carrier]) for carrier in growing}
        growing = [carrier for carrier, nbytes in grown.items() if nbytes is not None]
        sizes.update((carrier, nbytes) for carrier, nbytes in grown.items() if nbytes)
    return {
        carrier: Link.fit(
            (probe_sent(carrier, PROBE_SMALL, world_size), small[carrier]),
            (probe_sent(carrier, sizes[carrier], world_size), large[carrier]),
        )
        for carrier in CARRIERS
    }


@dataclasses.dataclass(frozen=True)
class PathCost:
    """One tensor on one path: CPU seconds before and after its collectives, the bytes
    this worker sends, the dependent rounds of messages, and the carrier (``CARRIERS``)."""

    before: float
    after: float
    sent: float
    rounds: float
    carrier: str


@dataclasses.dataclass(frozen=True)
class TensorTiming:
    """A tensor of the step, in backward order: when its gradient became ready (seconds
    after the first, with the paths' own work taken out) and its cost on each path it may
    take."""

    name: str
    ready: float
    costs: Mapping[str, PathCost]


def simulate(
    tensors: Sequence[TensorTiming],
    paths: Mapping[str, str],
    links: Mapping[str, Link],
    contention: float = 1.0,
) -> float:
    """Seconds from the first gradient's readiness until the last tensor is decoded, with
    tensor ``t`` on ``paths[t.name]`` and each carrier's ``links`` (see the module
    docstring)."""
    delay = link_free = 0.0
    done = []
    for tensor in tensors:
        cost = tensor.costs[paths[tensor.name]]
        link = links[cost.carrier]
        delay += cost.before * contention
        ready = tensor.ready + delay
        start = ready + cost.rounds * link.latency if ready >= link_free else link_free
        link_free = start + cost.sent * link.seconds_per_byte
        done.append((link_free, cost.after * contention))
    clock = (tensors[-1].ready + delay) if tensors else 0.0
    for finished, after in done:
        clock = max(clock, finished) + after
    return clock


# Mixing paths costs what the timeline does not see: Horovod runs one collective at a time
# on its background thread, and an fp16 sum takes CPU from the backward of every rank. A
# mix of paths must be predicted at least MIX_MARGIN faster than the best single path, and
# each tensor's switch at least SWITCH_GAIN of the step, to be taken.
MIX_MARGIN = 0.25
SWITCH_GAIN = 0.01


def choose(
    tensors: Sequence[TensorTiming],
    links: Mapping[str, Link],
    contention: float = 1.0,
    pin: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The path of every tensor that minimises ``simulate``, found greedily: from the best
    single path for every tensor, the largest tensors first, each tries its other paths
    with the others fixed and takes one that saves at least ``SWITCH_GAIN`` of the step,
    twice over; the mix stands only if it is predicted ``MIX_MARGIN`` faster than the best
    single path. Pinned tensors keep their path."""
    pin = dict(pin or {})
    singles = [uniform(tensors, path, pin) for path in sorted(PATHS, key=_PREFERENCE.get)]
    single, index = min(
        (simulate(tensors, start, links, contention), index) for index, start in enumerate(singles)
    )
    paths, best = dict(singles[index]), single
    order = sorted((t for t in tensors if t.name not in pin), key=lambda t: -t.costs["fp32"].sent)
    for _ in range(2):
        changed = False
        for tensor in order:
            current = paths[tensor.name]
            for path in sorted(tensor.costs, key=_PREFERENCE.get):
                if path == current:
                    continue
                paths[tensor.name] = path
                seconds = simulate(tensors, paths, links, contention)
                if seconds < best * (1 - SWITCH_GAIN):
                    best, current, changed = seconds, path, True
                paths[tensor.name] = current
        if not changed:
            break
    return paths if best < single * (1 - MIX_MARGIN) else dict(singles[index])


def path_traffic(
    codec,
    numel: int,
    world_size: int,
    exchange: str,
    itemsize: int = 4,
    allreduce_dtypes: Sequence[str] = cost.TORCH_ALLREDUCE_DTYPES,
) -> dict[str, tuple[float, float, str]]:
    """(bytes this worker sends, dependent rounds of messages, carrier) of a tensor of
    ``numel`` elements of ``itemsize`` bytes on each path; its codec's through
    ``exchange``. A shared scale's Max-allreduce is a round of its own before the codes,
    and the sharded exchange's allgather waits for its alltoall; the sharded rounds are
    shared by the tensors of a fusion group (``hvd_compress.fusion``), each paying its part
    of the group's bytes. Summed code values travel in an integer or fp16 allreduce, packed
    codes by allgather or alltoall."""
    compressed = cost.compressed_traffic(codec, numel, world_size, exchange, allreduce_dtypes)
    rounds = 1.0
    if exchange == "sharded":
        rounds = 2 * min(1.0, cost.alltoall_nbytes(codec, numel, world_size) / cost.FUSION_BYTES)
    rounds += codec.scaled and codec.shares_scale(exchange)
    carrier = "bytes"
    if exchange == "allreduce":
        dtype = codec.value_space.allreduce_carrier(world_size, allreduce_dtypes)
        carrier = "fp16" if dtype == "float16" else "fp32"
    return {
        "fp32": (cost.uncompressed_traffic(numel, world_size, itemsize).sent, 1, "fp32"),
        "fp16": (cost.uncompressed_traffic(numel, world_size, 2).sent, 1, "fp16"),
        "codec": (compressed.sent, rounds, carrier),
    }


def uniform(
    tensors: Sequence[TensorTiming], path: str, pin: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Every tensor on ``path`` where it can take it, else on fp32; pinned ones on their
    pin."""
    pin = pin or {}
    return {t.name: pin.get(t.name) or (path if path in t.costs else "fp32") for t in tensors}


@dataclasses.dataclass
class Decision:
    """What the last decision saw and chose: the link, each tensor's path, and the
    predicted exchange seconds of the chosen paths and of each path on every unpinned
    tensor."""

    step: int
    links: dict[str, Link]
    contention: float
    paths: dict[str, str]
    predicted: dict[str, float]
    # The most turns a side of its trials (``trial_turns``).
    trial_turns: int = TRIAL_TURNS
    # The trial of the decision's paths, where they differ from those in force: the median
    # step seconds under the paths replaced and under the decision's, the turns a side
    # timed, and whether the decision's stood (None while undecided); None until it is
    # first judged, and where nothing changed.
    trial: dict[str, float | bool | None] | None = None
    # The single path tried after a decision that kept the paths in force or whose trial
    # fell (``Planner._rival_of``), and its trial, as ``trial``; None where none was tried.
    challenger: str | None = None
    challenge: dict[str, float | bool | None] | None = None


def _seconds(trial: Mapping[str, float | bool | None]) -> str:
    """A trial's median steps, for the log."""
    return (
        f"{trial['seconds'] * 1e3:.1f} ms a step against "
        f"{trial['replaced_seconds'] * 1e3:.1f} ms under "
    )


def _outcome(trial: Mapping[str, float | bool | None], stood: str, fell: str) -> str:
    """A trial's outcome so far, for the log: ``stood``, ``fell`` or undecided."""
    if trial["kept"] is None:
        return f"undecided after {trial['turns']} turns a side, {TRIAL_TURNS} more"
    return f"{stood if trial['kept'] else fell} after {trial['turns']} turns a side"


class Planner:
    """The adaptive mode's state across steps: when to measure and decide, the latest
    measurements of every tensor, and the paths in force.

    The pipeline of a framework port reports what it measures (``ready``, ``spent``,
    ``end_step``), follows ``paths`` after every ``end_step`` (they change from step to
    step while ``judging``) and, when ``due``: while ``judging``, agrees on the
    ``trial_seconds`` with the other ranks and calls ``judge``; otherwise probes the link,
    agrees on the ``measurements`` and calls ``decide``.

    Args:
        options: the ``Adaptive`` options.
        compressible: names of the tensors the codec compresses (the others stay on fp32).
        step: the pipeline's step counter now; the warm-up starts here.
    """

    def __init__(self, options: Adaptive, compressible: Sequence[str], step: int = 0):
        self.options = options
        self.compressible = list(compressible)
        whole = set(options.pin) - set(compressible)
        if whole:
            raise ValueError(
                f"Adaptive: pin names tensors that the codec sends whole "
                f"whatever the mode: {sorted(whole)}"
            )
        self.decision: Decision | None = None
        self.restart(step)

    def restart(self, step: int) -> None:
        """A new warm-up from ``step``: every compressible tensor through the codec (or its
        pin), every measurement forgotten."""
        self.paths = {name: self.options.pin.get(name, "codec") for name in self.compressible}
        self.next_decision = step + self.options.warmup_steps
        self.ready: dict[str, float] = {}  # seconds after the first gradient, last step
        # (name, path, phase) -> CPU seconds, the latest step that measured them.
        self.cpu: dict[tuple[str, str, str], float] = {}
        self._measured = False  # whether the step under way is measured (``start_step``)
        self._step_cpu: collections.Counter = collections.Counter()
        self._before = self._before_wall = 0.0
        self._contentions: list[float] = []  # of each step that did work before its collectives
        self._step_seconds: list[float] = []  # of each measured step (``end_step``)
        self._trial: Trial | None = None  # while paths are on trial
        # The single path (its name and paths) to try if the decision's trial falls.
        self._rival: tuple[str, dict[str, str]] | None = None

    def path(self, name: str) -> str:
        return self.paths.get(name, "fp32")

    def due(self, step: int) -> bool:
        """Whether a decision follows the step that just ended (``step`` finished steps)."""
        return self.next_decision is not None and step >= self.next_decision

    # ----- what the pipeline measures during a step -----

    def start_step(self, step: int) -> bool:
        """Starts step ``step`` (counted from 0); returns whether it is measured: whether the
        pipeline reports its tensors' readiness and CPU work (``ready_at``, ``spent``). The
        warm-up's steps are, and the ``warmup_steps`` before each later decision, but not
        a trial's: the timing costs microseconds per tensor and phase that a step need not
        pay for a decision a thousand steps away, and that a trial's steps would pay
        unevenly."""
        self._step_cpu = collections.Counter()
        self._before = self._before_wall = 0.0
        self._measured = (
            self._trial is None
            and self.next_decision is not None
            and step >= self.next_decision - self.options.warmup_steps
        )
        return self._measured

    def ready_at(self, name: str, since_first: float) -> None:
        """Tensor ``name``'s gradient arrived ``since_first`` seconds (wall) after the
        step's first; the paths' work before their collectives so far this step, which ran
        on the same thread, is taken out."""
        self.ready[name] = max(since_first - self._before, 0.0)

    def spent(self, name: str, phase: str, seconds: float, wall: float) -> None:
        """CPU ``seconds`` (and ``wall`` seconds) of tensor ``name``'s path, ``phase``
        ``"before"`` or ``"after"`` its collectives (a phase may come in several calls)."""
        self._step_cpu[(name, phase)] += seconds
        if phase == "before":
            self._before += seconds
            self._before_wall += wall

    @property
    def contention(self) -> float:
        return statistics.median(self._contentions) if self._contentions else 1.0

    def end_step(self, seconds: float) -> None:
        """Keeps of a measured step the least CPU time seen of every tensor's path and
        phase and the step's contention; during a trial, times the step (``seconds`` from
        the first gradient's readiness until the exchange was done: what the paths change;
        the forward pass and the update do not depend on them) and puts in force the paths
        of the next."""
        if self._measured:
            self._step_seconds.append(seconds)
            for (name, phase), cpu in self._step_cpu.items():
                key = (name, self.path(name), phase)
                self.cpu[key] = min(cpu, self.cpu.get(key, cpu))
            # Below a millisecond of CPU the clocks' resolution would decide the ratio.
            if self._before > 1e-3:
                self._contentions.append(max(1.0, self._before_wall / self._before))
        if self._trial is not None:
            self.paths = dict(self._trial.step(seconds))

    def record(self, name: str, path: str, phase: str, seconds: float) -> None:
        """CPU ``seconds`` of tensor ``name`` on ``path`` in ``phase``, measured now."""
        self.cpu[(name, path, phase)] = seconds

    def report(self) -> dict:
        """The decision in force, for ``compression_stats()``: None before the first."""
        decision = self.decision
        if decision is None:
            return {
                "decided_at_step": None,
                "next_decision": self.next_decision,
                "paths": dict(self.paths),
            }
        return {
            "decided_at_step": decision.step,
            "next_decision": self.next_decision,
            "judging": self.judging,
            "trial": decision.trial,
            "challenger": decision.challenger,
            "challenge": decision.challenge,
            "links": {
                carrier: {
                    "latency_seconds": link.latency,
                    "bytes_per_second": 1 / link.seconds_per_byte
                    if link.seconds_per_byte
                    else float("inf"),
                }
                for carrier, link in decision.links.items()
            },
            "contention": decision.contention,
            "trial_turns": decision.trial_turns,
            "predicted_seconds": dict(decision.predicted),
            "paths": dict(self.paths),
            "counts": dict(collections.Counter(self.paths.values())),
        }

    def describe(self) -> str:
        """The decision in force in one line, for the log."""
        d = self.decision
        counts = collections.Counter(self.paths.values())
        return (
            ", ".join(f"{counts[p]} by {p}" for p in PATHS if counts[p])
            + f"; predicted exchange {d.predicted['chosen'] * 1e3:.1f} ms against "
            + ", ".join(f"{d.predicted[p] * 1e3:.1f} ms all {p}" for p in PATHS)
            + "; links "
            + ", ".join(
                f"{carrier} {link.latency * 1e6:.0f} us + {link.seconds_per_byte * 1e9:.2f} ns/byte"
                for carrier, link in d.links.items()
            )
            + f"; CPU contention {d.contention:.1f}"
            + (f"; every tensor by {d.challenger} on trial" if d.challenger else "")
        )

    # ----- the decision -----

    # Per tensor, in ``compressible`` order: ready, then before and after of each path
    # that does work on the CPU; -1 where not measured (every measurement is >= 0, so a
    # Max over the ranks keeps what any rank measured).
    MEASURED = (("codec", "before"), ("codec", "after"), ("fp16", "before"), ("fp16", "after"))

    def measurements(self) -> list[float]:
        """This rank's measurements, to be Max-allreduced with the other ranks': the
        contention, the median seconds of the measured steps (0 if none), then per tensor
        as ``MEASURED`` says."""
        steps = statistics.median(self._step_seconds) if self._step_seconds else 0.0
        row = [self.contention, steps]
        for name in self.compressible:
            row.append(self.ready.get(name, -1.0))
            row.extend(self.cpu.get((name,) + key, -1.0) for key in self.MEASURED)
        return row

    def timings(
        self, agreed: Sequence[float], traffic: Mapping[str, Mapping[str, tuple[float, float, str]]]
    ) -> tuple[list[TensorTiming], float, float]:
        """The tensors' timings from the ranks' ``agreed`` measurements and each path's
        (bytes sent, rounds, carrier) in ``traffic[name]``, in the order their gradients
        became ready; the contention; the step seconds. A path whose CPU time nobody
        measured is not offered (fp32 has none)."""
        width = 1 + len(self.MEASURED)
        contention, step_seconds, agreed = agreed[0], agreed[1], agreed[2:]
        result = []
        for index, name in enumerate(self.compressible):
            ready, *cpu = agreed[index * width : (index + 1) * width]
            measured = dict(zip(self.MEASURED, cpu))
            costs = {"fp32": PathCost(0.0, 0.0, *traffic[name]["fp32"])}
            for path in ("codec", "fp16"):
                before, after = measured[(path, "before")], measured[(path, "after")]
                if before >= 0 and after >= 0:
                    costs[path] = PathCost(before, after, *traffic[name][path])
            if name in self.options.pin and self.options.pin[name] not in costs:
                costs[self.options.pin[name]] = PathCost(
                    0.0, 0.0, *traffic[name][self.options.pin[name]]
                )
            result.append(TensorTiming(name, max(ready, 0.0), costs))
        return sorted(result, key=lambda t: t.ready), contention, step_seconds

    def decide(
        self,
        step: int,
        timings: Sequence[TensorTiming],
        links: Mapping[str, Link],
        contention: float,
        step_seconds: float = 0.0,
    ) -> Decision:
        """Chooses every compressible tensor's path from agreed measurements; returns the
        decision, whose ``paths`` are in force from the next step, on trial if they differ
        from those in force now. ``step_seconds`` (the agreed step of ``timings``) sets the
        length of its trials (``trial_turns``)."""
        replaced = dict(self.paths)
        paths = choose(timings, links, contention, self.options.pin)
        predicted = {"chosen": simulate(timings, paths, links, contention)}
        for path in PATHS:
            predicted[path] = simulate(
                timings, uniform(timings, path, self.options.pin), links, contention
            )
        self.paths.update(paths)
        turns = trial_turns(step_seconds, self.options.trial_seconds)
        self.decision = Decision(step, dict(links), contention, dict(self.paths), predicted, turns)
        self._rival = self._rival_of(timings, replaced)
        if self.paths != replaced:
            self._try(step, replaced, self.paths)
        elif self._rival is not None:
            self._challenge(step, replaced)
        else:
            self._schedule(step)
        return self.decision

    def _rival_of(
        self, timings: Sequence[TensorTiming], replaced: Mapping[str, str]
    ) -> tuple[str, dict[str, str]] | None:
        """The fastest single path whose paths differ from ``replaced`` and from the
        decision's, if predicted within ``CHALLENGE_MARGIN`` of the decision (the simpler
        path on a tie): its name and paths."""
        predicted = self.decision.predicted
        rivals = [
            (predicted[path], _PREFERENCE[path], path)
            for path in PATHS
            if predicted[path] <= CHALLENGE_MARGIN * predicted["chosen"]
            and uniform(timings, path, self.options.pin) not in (replaced, self.paths)
        ]
        if not rivals:
            return None
        path = min(rivals)[2]
        return path, uniform(timings, path, self.options.pin)

    def _challenge(self, step: int, replaced: dict[str, str]) -> None:
        """Puts the rival's paths (``_rival_of``) on trial against ``replaced``."""
        self.decision.challenger, paths = self._rival
        self._rival = None
        self._try(step, replaced, paths)

    def _try(self, step: int, replaced: dict[str, str], paths: dict[str, str]) -> None:
        """Puts ``paths`` on trial against ``replaced`` for ``TRIAL_TURNS`` turns a side,
        ``paths`` first."""
        self._trial = Trial(dict(paths), dict(replaced), TRIAL_TURNS)
        self.paths = dict(paths)
        self.next_decision = step + self._trial.steps

    @property
    def judging(self) -> bool:
        """Whether paths are on trial: the next ``due`` step judges them."""
        return self._trial is not None

    def trial_seconds(self) -> list[float]:
        """This rank's timed steps of the trial, the replaced paths' turns then those of
        the paths on trial, to be Max-allreduced with the other ranks' (the same length on
        every rank)."""
        return self._trial.timed["replaced"] + self._trial.timed["tried"]

    def judge(self, step: int, agreed: Sequence[float]) -> bool | None:
        """Judges the paths on trial (the decision's, or its challenger's) from the
        ``agreed`` ``trial_seconds`` (``trial_verdict``): keeps them if they stood; brings
        the replaced paths back if they fell, or if still undecided after
        ``decision.trial_turns`` turns a side, and then, after the decision's own trial,
        tries its rival against them; else extends the trial by ``TRIAL_TURNS`` turns a
        side. Returns the verdict: whether the paths on trial stood, None if extended."""
        trial, turns = self._trial, len(agreed) // 2
        replaced, tried = agreed[:turns], agreed[turns:]
        kept = trial_verdict(replaced, tried)
        extended = kept is None and turns < self.decision.trial_turns
        outcome = {
            "replaced_seconds": statistics.median(replaced),
            "seconds": statistics.median(tried),
            "turns": turns,
            "kept": None if extended else bool(kept),
        }
        if self.decision.challenger is None:
            self.decision.trial = outcome
        else:
            self.decision.challenge = outcome
        if extended:
            # The last turn was the replaced paths': the paths on trial are in force again.
            trial.extend(TRIAL_TURNS)
            self.next_decision = step + TRIAL_STEPS
            return None
        self._trial = None
        self.paths = dict(trial.tried if kept else trial.replaced)
        if not kept and self._rival is not None:
            self._challenge(step, trial.replaced)
        else:
            # A rival challenges only the trial it follows; the next decision finds its own.
            self._rival = None
            self._schedule(step)
        return bool(kept)

    def verdict(self) -> str:
        """The last judgement of a trial in one line, for the log."""
        decision = self.decision
        if decision.challenge is not None:
            outcome = _outcome(decision.challenge, "stood", "fell")
            return (
                f"challenger every tensor by {decision.challenger} {outcome}: "
                f"{_seconds(decision.challenge)}the paths in force before it"
            )
        outcome = _outcome(decision.trial, "kept", "reverted")
        verdict = f"{outcome}: {_seconds(decision.trial)}the paths it replaced"
        if self.judging and decision.challenger:
            verdict += f"; every tensor by {decision.challenger} on trial against them"
        return verdict

    def _schedule(self, step: int) -> None:
        every = self.options.every
        self.next_decision = step + every if every else None
