"""What the driver (``benchmarks.bench``) and its workers (``benchmarks.worker`` for
PyTorch, ``benchmarks.tf_worker`` for TensorFlow) share: the events they exchange, the
settings of the measurements, the TensorFlow methods' names and the interface counters the
workers read. Free of any framework, so that either worker imports only its own.

Rank 0 reports each measurement as one line ``@@bench {json}`` on its standard output
(through ``horovodrun``'s, on nodes reached over ssh); to change the link rate it prints a
``shape`` event and waits for the driver's reply, a file ``shaped.<k>`` beside the spec (a
launcher forwards no standard input to its ranks), and every rank waits for it at a barrier.
"""

import json
import os
import re
import statistics
import time

from hvd_compress import cost
from hvd_compress.accounting import HALF, UNCOMPRESSED

EVENT = "@@bench "
# ``horovodrun``'s prefix of each line a rank prints: ``[<rank>]<stdout>:``.
LAUNCHER_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")
# How long rank 0 waits for the driver to reshape the links (``tc`` takes well under a second).
SHAPE_SECONDS = 60.0
POLL_SECONDS = 0.01
# The paths a step can take on CPU tensors, whose ops ``benchmarks.op_count`` counts: by
# key, its name and the kernels it turns on (the CPU kernels, Triton's kernels with CPU
# tensors under the interpreter); neither is the eager ops.
OP_COUNT_PATHS = {
    "kernels": ("CPU kernels", True, False),
    "device": ("device path (Triton, interpreted)", False, True),
    "eager": ("eager ops", False, False),
}
# ``benchmarks.tf_op_count``'s --paths: name -> (the table's label, whether the CPU kernels
# run, whether the compiled calls of ``hvd_compress.tf.xla_fused`` run, whether CPU tensors
# take them). On a GPU every path but ``ops`` compiles: the CPU kernels take CPU tensors only.
TF_OP_COUNT_PATHS = {
    "xla": ("XLA-compiled calls (the GPU path)", False, True, True),
    "ops": ("TensorFlow ops, uncompiled", False, False, False),
    "kernels": ("CPU kernels", True, True, False),
}
# Learning rate of the timed steps (what is measured does not depend on it).
TIMING_LR = 0.01
# Timed steps of each compute baseline, whatever the model: a step without exchange is
# cheap (0.3 s for the 25M-parameter model at N = 4), and its median steadies with more.
COMPUTE_STEPS = 10
# A measurement (a timed step, a replay of bare collectives) whose first run took this many
# seconds on some rank is made once: only the 25M-parameter model's uncompressed exchanges at
# 100 Mbit/s take that long (4.4-14 s a step; every codec's step under 3.5 s), transfers
# bound by the link that repeat to within 5%, and repeating them took minutes of the matrix.
LONG_SECONDS = 4.0
# Seconds of timed steps a configuration is given (``Driver.repeated``), within the model's
# least and most steps: short steps are timed more often, since the adaptive mode's rows
# compare medians of several methods' steps and the least of several noisy medians sits
# below each one's own.
STEP_BUDGET_SECONDS = 2.0
# The TensorFlow port's methods (``benchmarks.tf_worker``), as rows of the same tables.
TF_METHODS = (
    "tf-hvd-none",
    "tf-hvd-fp16",
    "tf-terngrad",
    "tf-qsgd-inf",
    "tf-ef-sign",
    "tf-terngrad-auto",
    "tf-qsgd-inf-auto",
    "tf-ef-sign-auto",
)
TF_PREFIX = "tf-"
# A codec's method with ``adaptive=True`` (``<codec>-auto``), in either port.
AUTO_SUFFIX = "-auto"
# The PyTorch methods of a codec's two-level exchange (``<codec>-2l``).
TWO_LEVEL_SUFFIX = "-2l"
# The bare exchange inside the nodes of a two-level step (``benchmarks.worker.node_average``):
# on the nodes' unshaped loopback, not on their links.
NODE_AVERAGE = "node fp32 allreduce+allgather"


class Driver:
    """Rank 0's line to the driver process; the other ranks only join the barriers.

    Args:
        rank, size: this worker's Horovod rank and the job's size.
        allreduce: ``allreduce(name, value)``, a blocking Max-allreduce of the number
            ``value`` in the worker's framework under a collective name: the largest
            value over the ranks.
        directory: where the driver answers ``shape`` events (the spec's directory).
    """

    def __init__(self, rank, size, allreduce, directory):
        self.rank0 = rank == 0
        self.size = size
        self.allreduce = allreduce
        self.directory = directory
        self.collectives = 0  # the driver's own, each under a name of its own
        self.shapes = 0

    def emit(self, kind, **fields):
        if self.rank0:
            print(EVENT + json.dumps(dict(kind=kind, workers=self.size, **fields)), flush=True)

    def shape(self, rate):
        """Has the driver set every link to ``rate``; returns when all ranks know it."""
        if self.rank0:
            self.shapes += 1
            self.emit("shape", rate=rate, reply=self.shapes)
            reply = shaped_path(self.directory, self.shapes)
            deadline = time.monotonic() + SHAPE_SECONDS
            while not os.path.exists(reply):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the benchmark driver did not set the links to {rate} within "
                        f"{SHAPE_SECONDS:.0f} s"
                    )
                time.sleep(POLL_SECONDS)
        self.barrier()

    def barrier(self):
        self._largest("barrier", 0.0)

    def repeated(self, measure, count, most=None, budget=0.0):
        """The seconds of ``count`` calls of ``measure`` (which returns the seconds it
        took), or of more, up to ``most``, as many as take ``budget`` seconds at the pace
        of the first ``count`` calls' median; of the first alone if it took
        ``LONG_SECONDS`` or more on some rank. The ranks decide together, from the slowest
        rank's times, since each call runs collectives. A median paces where the first call
        would not: one slow call (a late rank, a page fault) would cut the count short."""
        seconds = [measure()]
        most = count if most is None else most
        if most == 1:
            return seconds
        if self._largest("long", seconds[0]) >= LONG_SECONDS:
            return seconds
        seconds += [measure() for _ in range(count - 1)]
        if most > count:
            pace = self._largest("pace", statistics.median(seconds))
            calls = min(most, max(count, int(budget / pace))) if pace > 0 else count
            seconds += [measure() for _ in range(calls - count)]
        return seconds

    def _largest(self, kind, value):
        """The largest of the ranks' ``value``, by the next of the driver's collectives."""
        self.collectives += 1
        return self.allreduce(f"bench.{kind}.{self.collectives}", value)


def shaped_path(directory, count):
    """The file by which the driver says that it set the links for ``count``-th ``shape``."""
    return os.path.join(directory, f"shaped.{count}")


def event_of(line):
    """The event a line of a job's output carries (``horovodrun``'s prefix or none), or
    None for any other line."""
    line = LAUNCHER_PREFIX.sub("", line, count=1)
    return json.loads(line[len(EVENT) :]) if line.startswith(EVENT) else None


def interface_bytes(interface):
    """(transmitted, received) bytes counted by this namespace's ``interface``; None on the
    loopback, whose counters include every other process of the machine."""
    if interface in (None, "lo"):
        return None
    base = f"/sys/class/net/{interface}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def difference(after, before, steps):
    """Per-step (transmitted, received) bytes between two ``interface_bytes`` readings."""
    if after is None:
        return None, None
    return (after[0] - before[0]) / steps, (after[1] - before[1]) / steps


def timed_steps(trainer, batches, steps):
    """Seconds of each of ``steps`` calls of ``trainer.step`` on the next of ``batches``."""
    seconds = []
    for _ in range(steps):
        inputs, targets = next(batches)
        start = time.perf_counter()
        trainer.step(inputs, targets)
        seconds.append(time.perf_counter() - start)
    return seconds


def timed_steps_of(driver, trainer, batches, steps):
    """``timed_steps`` as a configuration's measurement: ``steps`` = (least, most) of them,
    more where they are short, one if it is a long one (``Driver.repeated``)."""
    least, most = steps
    return driver.repeated(
        lambda: timed_steps(trainer, batches, 1)[0], least, most, STEP_BUDGET_SECONDS
    )


def compressed_tensors(tensors) -> int:
    """How many of a wrapper's ``compression_stats()["tensors"]`` the codec compressed
    (the others went by a plain allreduce)."""
    return sum(1 for _, _, route, _ in tensors if not route.startswith("allreduce ("))


def added_ops(codec, ops, baseline, tensors, compressed) -> dict:
    """The op counters' row of ``codec``: the ``ops`` of its step and what it adds to the
    ``baseline`` of ``none``, per model tensor (``tensors``) and per ``compressed`` one."""
    added = ops - baseline
    return {
        "codec": codec,
        "ops": ops,
        "added": added,
        "tensors": tensors,
        "compressed_tensors": compressed,
        "added_per_tensor": added / tensors,
        "added_per_compressed_tensor": added / compressed if compressed else None,
    }


def sent_bytes(codec, stats, world_size, nodes=None, node_allreduce=False):
    """Bytes a worker puts on the network in the step ``stats`` (a wrapper's
    ``compression_stats()``) describes, by ``hvd_compress.cost``: each tensor by the path
    it took; a two-level exchange's on both tiers, with ``nodes`` (``topology.Nodes``) and
    whether a node averaged by an allreduce."""
    if codec.message == "factors":  # factors and whole tensors alike by allreduce
        return cost.allreduce_traffic(stats["bytes_handed"], world_size).sent
    total = 0.0
    for _, numel, exchange, _ in stats["tensors"]:
        if exchange == cost.TWO_LEVEL:
            total += cost.two_level_traffic(
                codec,
                numel,
                nodes.local_size,
                nodes.cross_size,
                node_allreduce=node_allreduce,
            ).sent
        elif exchange in (UNCOMPRESSED, HALF):
            itemsize = 2 if exchange == HALF else 4
            total += cost.uncompressed_traffic(numel, world_size, itemsize).sent
        elif codec.message == "own_indices":  # k of the last step
            total += cost.top_k_traffic(codec.k(numel, stats["step"] - 1), world_size).sent
        else:
            total += cost.compressed_traffic(codec, numel, world_size, exchange).sent
    return total
