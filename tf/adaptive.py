"""The adaptive mode's part of a ``CompressionPipeline`` step in TensorFlow: each compressed
tensor's exchange by the path in force, the step's end, where the planner
(``hvd_compress.adaptive``) is told the step's time and, when one is due, the codec's and
the link's costs are measured, every rank agrees on them and the decision is taken.

Mirrors ``hvd_compress.pt.adaptive``, where the gradients' hooks time each tensor's work as
the step runs. A traced step cannot: its tensors' work runs concurrently on the executor's
threads, where no clock sees one tensor's share. So the step itself only reads the paths
in force (``PipelineState.paths``, one ``tf.switch_case`` per tensor, which a decision
changes without tracing the step again) and ends in a Python call (``tf.py_function``)
that times whole steps. The codec's work is timed between steps, at a decision, by eager
calls that run each tensor's exchange on the codec and on fp16, one tensor after the
other, with timestamps around the work before and after its collectives (``_timing_pass``).
Eager, because that call runs on one of the executor's inter-op threads: a ``tf.function``
called from it waits for another, and on one inter-op thread the job would hang.
"""

import contextlib
import logging
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvd_compress.adaptive import (
    CARRIERS,
    PATHS,
    fit_links,
    path_traffic,
)

from .exchange import codes_name, collective_name, watched
from .fusion import AlltoallFusion

log = logging.getLogger("hvd_compress")

# The adaptive mode's probes: the fastest of this many of each (``_probe``), as in the
# PyTorch port. A collective under a name Horovod has not seen yet negotiates in full, and
# any can meet a rank descheduled.
_PROBE_REPEATS = 5
# Timing passes per decision (``_timing_pass``); of each tensor's spans the least is
# kept, as the PyTorch port keeps the least of its warm-up's steps.
_TIMING_PASSES = 3


def max_over_ranks(values, name, process_set):
    """The element-wise Max of the float ``values`` over the ranks of ``process_set``, as
    a list; eager."""
    with watched("allreduce", name, process_set):
        agreed = hvd.allreduce(
            tf.constant(values, tf.float64),
            op=hvd.Max,
            name=name,
            ignore_name_scope=True,
            process_set=process_set,
        )
    return agreed.numpy().tolist()


def _flat(grad):
    """``grad`` as the flat float32 vector its exchanges take."""
    return tf.reshape(tf.cast(grad, tf.float32), [-1])


def _alone(group, plan, k):
    """An alltoall fusion of ``plan``'s tensor alone, member ``k`` of ``group``: for its
    codec's exchange while another member of the group is on another path."""
    return AlltoallFusion([codes_name(plan)], f"{group.name}.{k}", group.process_set)


class AdaptiveSteps:
    """The adaptive mode of a ``CompressionPipeline`` (a mixin of it), driven by its
    ``state.planner``."""

    _last_step_end = None  # perf_counter() at the end of the last step (``_end_step``)

    def follow_paths(self):
        """Puts the planner's paths in force: the variable the traced step reads, and each
        tensor's route for ``compression_stats()``. Every step, so that a restored
        checkpoint's variable follows the planner too."""
        planner = self.state.planner
        for plan in self.plans:
            if plan.name in planner.paths:
                plan.path = planner.path(plan.name)
        with tf.init_scope():
            self.state.paths.assign([PATHS.index(planner.path(n)) for n in planner.compressible])

    # ----- in the traced step -----

    def _by_paths(self, group, members, lr_ratio):
        """(decoded flat float32 gradient, whether finite) of each (index, plan, grad) of
        ``members``, the compressed tensors of one alltoall fusion ``group`` (None: those
        whose exchange has none), each exchanged by the path in force."""
        if group is None or len(members) == 1:
            return [self._by_path(plan, grad, lr_ratio, group) for _, plan, grad in members]
        return self._by_group_paths([(plan, grad) for _, plan, grad in members], lr_ratio, group)

    def _by_path(self, plan, grad, lr_ratio, fusion):
        """Exchanges ``grad`` of ``plan``'s tensor by the path in force (``state.paths``):
        its codec's exchange, or an fp16 or fp32 allreduce that also carries its residuals
        (the worker's, and the server's in worker units, which are then proposed empty: a
        tensor that comes back to its codec starts with none). Returns the decoded flat
        float32 gradient and whether it is finite."""
        return self._adopt(plan, self._path_outputs(plan, _flat(grad), lr_ratio, fusion))

    def _by_group_paths(self, members, lr_ratio, fusion):
        """``_by_path`` of each (plan, grad) of ``members``, the sharded tensors of one
        alltoall ``fusion`` group: while all of them are on their codec, as the codec alone
        would exchange them, every member's rows in the group's one alltoall; else each by
        its own path, a member on its codec in an alltoall of its own. A path is chosen as
        the step runs, so the group can only travel together while every member's is the
        codec: Horovod runs each alltoall on its own, and one per tensor costs its latency
        on every tensor, which would make the mode slower than its codec where it changes
        nothing."""
        vectors = [(plan, _flat(grad)) for plan, grad in members]
        indices = [self.state.planner.compressible.index(plan.name) for plan, _ in members]
        on_codec = tf.reduce_all(
            tf.equal(tf.gather(self.state.paths, indices), PATHS.index("codec"))
        )

        def together():
            started = []
            for plan, vector in vectors:
                with self._handing() as handed:
                    pending = self._start(plan, vector, lr_ratio, fusion)
                started.append((pending, handed))
            outputs = []
            for (plan, _), (pending, handed) in zip(vectors, started):
                with self._handing() as more:
                    decoded = self.exchanges[plan.name].finish(pending)
                outputs.append(self._codec_outputs(plan, decoded, handed + more))
            return outputs

        def apart():
            return [
                self._path_outputs(plan, vector, lr_ratio, _alone(fusion, plan, k))
                for k, (plan, vector) in enumerate(vectors)
            ]

        outputs = tf.cond(on_codec, together, apart)
        return [self._adopt(plan, out) for (plan, _), out in zip(members, outputs)]

    def _path_outputs(self, plan, vector, lr_ratio, fusion):
        """The outputs (``_outputs``) of the exchange of the flat float32 ``vector`` of
        ``plan``'s tensor by the path in force, one ``tf.switch_case`` branch per path.
        The branches cannot hand out the tensors they make, so the bytes handed to Horovod
        and the proposed residuals leave each branch as its outputs, to be counted and
        proposed after it (``_adopt``)."""

        def codec():
            with self._handing() as handed:
                decoded = self.exchanges[plan.name].finish(
                    self._start(plan, vector, lr_ratio, fusion)
                )
            return self._codec_outputs(plan, decoded, handed)

        def plain(dtype):
            # The gradient with its residuals, the server's moved into the worker's as the
            # PyTorch port moves it. One add of the scaled sum, never a chain of adds:
            # grappler rewrites a chain in a branch into a temporary variable named after
            # the branch, which two tensors' branches then create in the same step.
            residual = None if self.state.worker is None else self.state.worker.residuals[plan.name]
            if self.state.server is not None and plan.name in self.state.server.residuals:
                server = self.state.server.residuals[plan.name]
                residual = residual + self._server_mass(plan.name, server, self.world_size)
            sent = vector if residual is None else vector + residual * lr_ratio
            for memory in self._memories(plan):
                memory.propose(plan.name, tf.zeros_like(memory.residuals[plan.name]))
            with self._handing() as handed:
                decoded = tf.cast(self._allreduce(plan, tf.cast(sent, dtype)), tf.float32)
            return self._outputs(plan, decoded, tf.reduce_all(tf.math.is_finite(decoded)), handed)

        index = self.state.planner.compressible.index(plan.name)
        return tf.switch_case(
            self.state.paths[index],
            [codec, lambda: plain(tf.float16), lambda: plain(tf.float32)],
        )

    def _memories(self, plan):
        """The memories that hold residuals of ``plan``'s tensor: the worker's, the server's."""
        return [
            memory
            for memory in (self.state.worker, self.state.server)
            if memory is not None and plan.name in memory.residuals
        ]

    def _codec_outputs(self, plan, decoded, handed):
        """``_outputs`` of ``plan``'s tensor exchanged by its codec, ``decoded``."""
        finite = self.exchanges[plan.name].finite
        if finite is None:
            finite = tf.reduce_all(tf.math.is_finite(decoded))
        return self._outputs(plan, decoded, finite, handed)

    def _outputs(self, plan, decoded, finite, handed):
        """What a branch hands out of ``plan``'s tensor: [decoded, finite, the bytes it
        handed to Horovod (``handed``, summed), the residuals it proposed]."""
        nbytes = tf.add_n(handed) if handed else tf.constant(0, tf.int64)
        proposed = [memory.proposed.pop(plan.name) for memory in self._memories(plan)]
        return [decoded, finite, nbytes, *proposed]

    def _adopt(self, plan, outputs):
        """Counts and proposes what a branch handed out (``_outputs``); returns its decoded
        gradient and whether it is finite."""
        decoded, finite, nbytes, *residuals = outputs
        self.meter.counts.append(nbytes)
        self.meter.by_tensor[plan.name] = nbytes
        for memory, residual in zip(self._memories(plan), residuals):
            memory.propose(plan.name, residual)
        return decoded, finite

    @contextlib.contextmanager
    def _handing(self):
        """Yields a list that receives the byte counts of what the block hands to Horovod
        (``Meter.hand``), which then leave the meter: the block's tensors are a branch's
        or a timing pass's, which the step's accounting cannot read."""
        meter = self.meter
        counts, clock, by_tensor = len(meter.counts), len(meter.clock), dict(meter.by_tensor)
        handed = []
        try:
            yield handed
        finally:
            handed.extend(meter.counts[counts:])
            del meter.counts[counts:], meter.clock[clock:]
            meter.by_tensor = by_tensor

    def _allreduce(self, plan, tensor):
        """``tensor`` (fp16 or fp32, the tensor's path) averaged (or summed) by Horovod's
        allreduce, scaled as the tensors sent whole are."""
        return hvd.allreduce(
            self.meter.hand(tensor),
            op=hvd.Average if self.average else hvd.Sum,
            prescale_factor=self.prescale_factor,
            postscale_factor=self.postscale_factor,
            name=f"{collective_name(plan)}.{tensor.dtype.name}",
            ignore_name_scope=True,
            process_set=self.process_set,
        )

    def _mark_step_end(self, outputs):
        """An op that runs ``_end_step`` once the step's ``outputs`` and its step counter
        are done; eagerly, the call itself."""
        with tf.control_dependencies(tf.nest.flatten(outputs, expand_composites=True)):
            tf.py_function(self._end_step, [], [])

    # ----- between steps (Python) -----

    def _end_step(self):
        """Hands the planner the step that just ended and, when one is due, takes its
        decision or judges its trial, on every rank at the same step (as the PyTorch port's
        ``_end_adaptive_step``). The step's time is the wall time since the last step's
        end: the forward and backward passes and the update with the exchange, where the
        PyTorch port times the exchange's window only. The first step, which has no last
        one (and traced the step), is not timed."""
        planner = self.state.planner
        step = int(self.state.step.numpy())
        if self._last_step_end is not None:
            planner.start_step(step - 1)
            planner.end_step(time.perf_counter() - self._last_step_end)
        if planner.due(step):
            if planner.judging:
                self._judge(step)
            else:
                self._decide(step)
        self.follow_paths()
        # What the decision took is not the next step's.
        self._last_step_end = time.perf_counter()

    def _decide(self, step):
        """Measures the codec's and the fp16 casts' work per tensor (``_timing_pass``) and
        the links, agrees with every rank on the measurements and takes the planner's
        decision (``hvd_compress.adaptive``)."""
        planner = self.state.planner
        spans = np.min([self._timing_pass() for _ in range(_TIMING_PASSES)], axis=0)
        for name, row in zip(planner.compressible, spans):
            for (path, phase), seconds in zip(planner.MEASURED, row):
                planner.record(name, path, phase, float(seconds))
        links = self._probe_links()
        agreed = max_over_ranks(
            planner.measurements(), "hvdc.adaptive.measurements", self.process_set
        )
        plans = {plan.name: plan for plan in self.plans}
        traffic = {
            name: path_traffic(
                self.codec,
                plans[name].numel,
                self.world_size,
                plans[name].exchange,
                self.dtypes[plans[name].index].size,
            )
            for name in planner.compressible
        }
        timings, contention, step_seconds = planner.timings(agreed, traffic)
        planner.decide(step, timings, links, contention, step_seconds)
        if self.rank == 0:
            log.info("hvd_compress adaptive, step %d: %s", step, planner.describe())

    def _judge(self, step):
        """Agrees with every rank on the step times of the paths on trial and keeps,
        reverts or goes on trying them (``adaptive.Planner.judge``)."""
        planner = self.state.planner
        timed = planner.trial_seconds()
        # Named by its length: an extended trial's steps are another tensor.
        agreed = max_over_ranks(timed, f"hvdc.adaptive.trial.{len(timed)}", self.process_set)
        planner.judge(step, agreed)
        if self.rank == 0:
            log.info(
                "hvd_compress adaptive, step %d: decision of step %d %s",
                step,
                planner.decision.step,
                planner.verdict(),
            )

    def _timing_pass(self):
        """Each compressed tensor's work on the codec and on fp16, before and after its
        collectives (seconds, a row per tensor of ``planner.compressible`` in the order of
        ``Planner.MEASURED``), timed one tensor after the other so that no other tensor's
        work runs meanwhile; eager (the module's docstring says why), so each call returns
        once its ops and collectives are done, and each op's dispatch counts in its time.
        The codec's work before its collectives ends when its largest payload is handed to
        Horovod (``Meter.clock``). Wall time, which with more ranks than cores includes
        waiting for a core, as the step's work does: the contention is then 1. The gradient
        is a stand-in of its size (normal draws: codes as dense as a gradient's),
        compensated with the residuals in force; what the pass proposes is dropped."""
        planner = self.state.planner
        plans = {plan.name: plan for plan in self.plans}
        memories = [m for m in (self.state.worker, self.state.server) if m is not None]
        proposed = [dict(memory.proposed) for memory in memories]
        rows = []
        for name in planner.compressible:
            plan = plans[name]
            vector = tf.random.stateless_normal([plan.numel], [plan.index, 0])
            with self._handing():
                # A sharded tensor's codes travel alone: its fusion group has one member.
                fusion = AlltoallFusion(
                    [codes_name(plan)], f"hvdc.timing.{plan.index}", self.process_set
                )
                begun = len(self.meter.clock)
                start = time.perf_counter()
                pending = self._start(plan, vector, 1.0, fusion)
                arrived = time.perf_counter()
                encoded, _ = max(self.meter.clock[begun:], key=lambda hand: hand[1])
                self.exchanges[name].finish(pending)
                done = time.perf_counter()
                half = tf.cast(vector, tf.float16)
                halved = time.perf_counter()
                total = self._allreduce(plan, half)
                summed = time.perf_counter()
                tf.cast(total, tf.float32)
                restored = time.perf_counter()
            rows.append([encoded - start, done - arrived, halved - done, restored - summed])
        for memory, before in zip(memories, proposed):
            memory.proposed = before
        return rows

    def _probe_links(self):
        """Every carrier's ``Link`` (``adaptive.fit_links``), as the PyTorch port's."""
        return fit_links(self._probe, self.world_size)

    def _probe(self, probes):
        """Seconds of the fastest of ``_PROBE_REPEATS`` eager collectives of each (carrier,
        nbytes) of ``probes``, the slowest rank's, taking turns after an allreduce that
        every rank must reach (as the PyTorch port's ``_probe``)."""
        ranks = self.process_set
        collectives = []
        for carrier, nbytes in probes:
            dtype, collective = CARRIERS[carrier]
            dtype = tf.as_dtype(dtype)
            tensor = tf.zeros([nbytes // dtype.size], dtype)
            collectives.append((collective, tensor, f"hvdc.adaptive.{carrier}.{nbytes}"))
        with watched("allreduce", "hvdc.adaptive.arrive", ranks):
            hvd.allreduce(
                tf.zeros([1]), op=hvd.Sum, name="hvdc.adaptive.arrive", process_set=ranks
            ).numpy()
        best = [float("inf")] * len(collectives)
        for _ in range(_PROBE_REPEATS):
            for i, (collective, tensor, name) in enumerate(collectives):
                with watched(collective, name, ranks):
                    start = time.perf_counter()
                    if collective == "allgather":
                        result = hvd.allgather(tensor, name=name, process_set=ranks)
                    else:
                        result = hvd.allreduce(tensor, op=hvd.Sum, name=name, process_set=ranks)
                    result.numpy()
                    best[i] = min(best[i], time.perf_counter() - start)
        agreed = ".".join(f"{carrier}{nbytes}" for carrier, nbytes in probes)
        return max_over_ranks(best, f"hvdc.adaptive.seconds.{agreed}", ranks)
