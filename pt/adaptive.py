"""The adaptive mode's part of a ``CompressionPipeline`` step: timing each tensor's work in
the steps the planner measures, probing the link, agreeing with every rank on the
measurements, and taking the planner's decisions (``hvd_compress.adaptive``), which
``CompressionPipeline.follow_paths`` puts in force.
"""

import contextlib
import logging
import time

import horovod.torch as hvd
import torch

from hvd_compress.adaptive import (
    CARRIERS,
    fit_links,
    path_traffic,
)

from .exchange import allgather_async, allreduce_async_, wait
from .world import max_over_ranks

log = logging.getLogger("hvd_compress")

# The block of a step the planner does not measure (``AdaptiveSteps._timed``).
_UNMEASURED = contextlib.nullcontext()

# The adaptive mode's probes: the fastest of this many of each (``_probe_links``). A
# collective under a name Horovod has not seen yet negotiates in full, and any can meet a
# rank descheduled.
_PROBE_REPEATS = 5


class _Stopwatch:
    """The time of the block's work on ``device``, as the codecs' is measured (``_timed``):
    the thread's CPU time, or on a CUDA device the device's between CUDA events, waited for
    at the block's end (a decision's step waits for its probes anyway)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.seconds = None

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.start = time.thread_time()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.thread_time() - self.start


class AdaptiveSteps:
    """The adaptive mode of a ``CompressionPipeline`` (a mixin of it), driven by its
    ``state.planner``."""

    def _start_measuring(self, param):
        """Starts a step whose first gradient is ``param``'s: whether the planner measures
        it, and on a CUDA device with events (``_timed``)."""
        self._measuring = self.state.planner is not None and self.state.planner.start_step(
            self.state.step
        )
        on_cuda = self._measuring and param.device.type == "cuda"
        self._device_spans = [] if on_cuda else None

    def _ready(self, name):
        """Tells a measuring planner that tensor ``name``'s gradient has arrived."""
        if self._measuring:
            self.state.planner.ready_at(name, time.perf_counter() - self._step_started)

    def _end_adaptive_step(self):
        """Hands the planner the step's times and, when one is due, takes its decision or
        judges its trial; between steps, on every rank at the same step."""
        planner = self.state.planner
        self._spent_on_device()
        planner.end_step(time.perf_counter() - self._step_started)
        if planner.due(self.state.step):
            if planner.judging:
                self._judge()
            else:
                self._decide()
        elif planner.judging:  # the paths on trial and those they would replace alternate
            self.follow_paths()

    def _decide(self):
        """Probes the link, agrees with every rank on the measurements and takes the
        planner's decision (``hvd_compress.adaptive``); called between steps, on every
        rank at the same step."""
        planner = self.state.planner
        plans = {plan.name: (param, plan) for param, plan in self.plans.items()}
        for name in planner.compressible:
            grad = plans[name][0].grad
            if grad is not None and not grad.is_sparse:
                with _Stopwatch(grad.device) as cast:
                    half = grad.to(torch.float16)
                planner.record(name, "fp16", "before", cast.seconds)
                with _Stopwatch(grad.device) as cast:
                    half.to(grad.dtype)
                planner.record(name, "fp16", "after", cast.seconds)
        links = self._probe_links(next(iter(self.plans)).device)
        agreed = max_over_ranks(
            planner.measurements(), "hvdc.adaptive.measurements", self.process_set
        )
        traffic = {
            name: path_traffic(
                self.codec, plan.numel, self.world_size, plan.exchange, param.element_size()
            )
            for name, (param, plan) in plans.items()
            if name in planner.paths
        }
        timings, contention, step_seconds = planner.timings(agreed, traffic)
        planner.decide(self.state.step, timings, links, contention, step_seconds)
        self.follow_paths()
        if self.rank == 0:
            log.info("hvd_compress adaptive, step %d: %s", self.state.step, planner.describe())

    def _judge(self):
        """Agrees with every rank on the step times of the paths on trial and keeps,
        reverts or goes on trying them (``adaptive.Planner.judge``); called between steps,
        on every rank at the same step."""
        planner = self.state.planner
        timed = planner.trial_seconds()
        # Named by its length: an extended trial's steps are another tensor.
        agreed = max_over_ranks(timed, f"hvdc.adaptive.trial.{len(timed)}", self.process_set)
        planner.judge(self.state.step, agreed)
        self.follow_paths()
        if self.rank == 0:
            log.info(
                "hvd_compress adaptive, step %d: decision of step %d %s",
                self.state.step,
                planner.decision.step,
                planner.verdict(),
            )

    def _probe_links(self, device):
        """Every carrier's ``Link`` (``adaptive.fit_links``), probed on ``device``."""
        return fit_links(lambda probes: self._probe(probes, device), self.world_size)

    def _probe(self, probes, device):
        """Seconds of the fastest of ``_PROBE_REPEATS`` collectives of each (carrier,
        nbytes) of ``probes``, the slowest rank's. The probes take turns, so that a burst of
        noise (a rank descheduled, Horovod's background thread busy) falls on all of them
        rather than on every repeat of one carrier, which would then look slower than the
        others. An allreduce that every rank must reach comes first, so that a late rank
        delays the probes but is not measured as the link."""
        ranks = self.process_set
        collectives = []
        for carrier, nbytes in probes:
            dtype, collective = CARRIERS[carrier]
            dtype = getattr(torch, dtype)
            tensor = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=device)
            collectives.append((collective, tensor, f"hvdc.adaptive.{carrier}.{nbytes}"))
        arrive = torch.zeros(1, device=device)
        wait(allreduce_async_(arrive, op=hvd.Sum, name="hvdc.adaptive.arrive", process_set=ranks))
        best = [float("inf")] * len(collectives)
        for _ in range(_PROBE_REPEATS):
            for i, (collective, tensor, name) in enumerate(collectives):
                start = time.perf_counter()
                if collective == "allgather":
                    handle = allgather_async(tensor, name=name, process_set=ranks)
                else:
                    handle = allreduce_async_(tensor, op=hvd.Sum, name=name, process_set=ranks)
                wait(handle, spin=True)
                best[i] = min(best[i], time.perf_counter() - start)
        agreed = ".".join(f"{carrier}{nbytes}" for carrier, nbytes in probes)
        return max_over_ranks(best, f"hvdc.adaptive.seconds.{agreed}", ranks)

    def _timed(self, name, phase):
        """Charges the time of the block's work to tensor ``name``'s ``phase``
        (``adaptive.Planner.spent``) in the steps the planner measures: the thread's CPU
        time, or on a CUDA device the device's, between CUDA events around the block (the
        thread's time there would see only the kernels' launches). In the other steps it
        does nothing, at the cost of a shared context manager rather than a generator's."""
        return self._measured(name, phase) if self._measuring else _UNMEASURED

    @contextlib.contextmanager
    def _measured(self, name, phase):
        wall = time.perf_counter()
        if self._device_spans is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._device_spans.append((name, phase, start, end, time.perf_counter() - wall))
            return
        start = time.thread_time()
        try:
            yield
        finally:
            self.state.planner.spent(
                name, phase, time.thread_time() - start, time.perf_counter() - wall
            )

    def _spent_on_device(self):
        """Hands the planner a measured step's device times. Reading them waits for the
        device once, at the end of the step, and only in the steps the planner measures
        (the warm-up and the few before each decision): the events of one stream complete
        in order, so waiting for the last waits for all."""
        spans, self._device_spans = self._device_spans, None
        if not spans:
            return
        spans[-1][3].synchronize()
        for name, phase, start, end, wall in spans:
            self.state.planner.spent(name, phase, start.elapsed_time(end) / 1e3, wall)
