"""The program every rank of a benchmark job runs: ``python -m benchmarks.worker SPEC``.

``SPEC`` is the JSON the driver (``benchmarks.bench``) writes: models, methods, link rates,
step counts. For each model the ranks replay Horovod's bare collectives at every rate, then
for every method measure the local compute (forward, backward and SGD step with no
exchange) and run the method at every rate: warm-up steps at the first (fastest) rate, then
timed steps after the driver reshaped the links. Rank 0 reports each measurement to the
driver as one line ``@@bench {json}`` on its standard output; to change the link rate it
prints a ``shape`` event and waits for the driver's reply on its standard input, and every
rank waits for it at a barrier. Optionally, the MNIST-1D CNN is then trained with each
method at one rate, recording test accuracy against training time.
"""

import gc
import json
import os
import statistics
import sys
import time

import horovod.torch as hvd
import torch

from hvd_compress import cost
from hvd_compress.pt import topology
from hvd_compress.pt.exchange import wait

from .collectives import HorovodProbe, allreduce_of, reference_ceilings, replay
from .methods import (
    CODEC_METHODS,
    METHODS,
    TWO_LEVEL_METHODS,
    Trainer,
    accuracy_trainer,
    init_ddp,
    needs_ddp,
    needs_process_sets,
    sgd,
)
from .models import flush_subnormals, workload
from .protocol import (
    COMPUTE_STEPS,
    NODE_AVERAGE,
    TIMING_LR,
    Driver,
    difference,
    interface_bytes,
    timed_steps,
    timed_steps_of,
)

# Seconds of idle traffic counted to measure Horovod's control messages.
IDLE_SECONDS = 2.0


def measure_compute(driver, work, batches, method):
    """The step with no exchange, measured again before each method's steps: the report
    takes the median of these baselines, which no single disturbed measurement moves."""
    model = work.build()
    trainer = Trainer(model, sgd(model, TIMING_LR), hvd.size())  # no exchange at all
    timed_steps(trainer, batches, 2)
    seconds = []
    for _ in range(COMPUTE_STEPS):
        # Started together, as a method's exchange lines its steps up: ranks left to drift
        # overlap on the cores by chance (the 25M-parameter model at N = 4 took 142-686 ms
        # per step, and medians of 10 steps 270-400 ms; 250-310 ms with the barrier).
        driver.barrier()
        seconds += timed_steps(trainer, batches, 1)
    driver.emit("compute", model=work.name, method=method, seconds=statistics.median(seconds))


def node_average(model):
    """The part of a two-level step inside the nodes, bare: every node at once averages
    each of ``model``'s gradients, zero-padded to its ranks' shards, by an allreduce among
    its ranks, and gathers the shards (as CPU tensors take it,
    ``hvd_compress.topology.averages_by_allreduce``), all handed to Horovod together, as a
    step hands them (Horovod fuses them). Returns a function that runs it once and returns
    the seconds it took, and the bytes a worker sends; None where every node holds one
    rank. Collective (it joins the nodes' process sets)."""
    nodes = topology.current_nodes()
    local = nodes.local_size
    if local == 1:
        return None
    node_set, _ = topology.join(nodes)
    _, shard = nodes.locate(hvd.rank())
    padded = {
        name: torch.zeros(local * nodes.shard_length(p.numel()))
        for name, p in model.named_parameters()
    }

    def run():
        start = time.perf_counter()
        averages = {
            name: hvd.allreduce_async_(v, name=f"bare.node.{name}", process_set=node_set)
            for name, v in padded.items()
        }
        gathers = [
            hvd.allgather_async(
                wait(handle).view(local, -1)[shard],
                name=f"bare.node.{name}.gather",
                process_set=node_set,
            )
            for name, handle in averages.items()
        ]
        for handle in gathers:
            wait(handle)
        return time.perf_counter() - start

    # The cost model's traffic of a two-level exchange on one node: no codec takes part.
    sent = sum(
        cost.two_level_traffic(None, p.numel(), local, 1, node_allreduce=True).sent
        for p in model.parameters()
    )
    return run, sent


def measure_bare(driver, work, rates, repeats, in_nodes=False):
    """Horovod's bare collectives for the whole model at every rate; ``in_nodes`` (a job
    with process sets on nodes of several ranks), also those inside the nodes of a
    two-level step (``node_average``)."""
    model = work.build()
    numel = sum(p.numel() for p in model.parameters())
    exchanges = {
        "fp32 allreduce": allreduce_of(model, torch.float32),
        "fp16 allreduce": allreduce_of(model, torch.float16),
        **reference_ceilings(numel, hvd.size()),
    }
    inside = node_average(model) if in_nodes else None
    if inside is not None:
        run_inside, sent_inside = inside
        run_inside()  # the first run allocates Horovod's buffers and the gathers' pages
    for rate in rates:
        driver.shape(rate)
        measured = {}
        for name, collectives in exchanges.items():
            tag = name.replace(" ", "-")
            seconds = driver.repeated(lambda: replay(collectives, tag), repeats)
            measured[name] = {
                "seconds": statistics.median(seconds),
                "sent": sum(c.sent(hvd.size()) for c in collectives),
            }
        if inside is not None:
            measured[NODE_AVERAGE] = {
                "seconds": statistics.median(driver.repeated(run_inside, repeats)),
                "sent": sent_inside,
            }
        driver.emit("bare", model=work.name, rate=rate, exchanges=measured)


def measure_method(driver, work, batches, method, rates, steps, repeats, interface):
    """Warm-up at the first rate, then timed steps (and the bare replay of the method's own
    collectives, for hvd_compress codecs) at every rate."""
    trainer = None
    for rate in rates:
        driver.shape(rate)
        if trainer is None or trainer.per_rate:
            trainer = METHODS[method](work.build(), hvd.size(), TIMING_LR)
            timed_steps(trainer, batches, trainer.warmup_steps - 1)
            while trainer.on_trial():  # the same on every rank: the decisions are agreed
                timed_steps(trainer, batches, 1)
            with HorovodProbe() as probe:
                timed_steps(trainer, batches, 1)
            recorded = probe.collectives if method in CODEC_METHODS else None
            driver.barrier()
        before = interface_bytes(interface)
        with HorovodProbe() as probe:
            seconds = timed_steps_of(driver, trainer, batches, steps)
        # A rank's last step can return while its final send still waits in its link's tbf
        # queue; the barrier's bytes queue behind it, so once every rank has passed the barrier
        # the step's bytes have been counted.
        driver.barrier()
        tx, rx = difference(interface_bytes(interface), before, len(seconds))
        result = dict(
            model=work.name,
            method=method,
            rate=rate,
            step_seconds=seconds,
            seconds=statistics.median(seconds),
            handed=trainer.handed(),
            sent=trainer.sent(),
            wire_tx=tx,
            wire_rx=rx,
        )
        if method in CODEC_METHODS or method in TWO_LEVEL_METHODS:
            result["wait_seconds"] = probe.wait_seconds / len(seconds)
        if method in CODEC_METHODS:
            result["bare_seconds"] = statistics.median(
                driver.repeated(lambda: replay(recorded, method), repeats)
            )
            result["bare_sent"] = sum(c.sent(hvd.size()) for c in recorded)
            result["adaptive"] = trainer.optimizer.compression_stats().get("adaptive")
        driver.emit("step", **result)
    del trainer
    gc.collect()


def accuracy_curve(driver, work, method, rate, steps, every, lr):
    """Trains ``method`` from scratch for ``steps`` (cosine learning rate from ``lr``) and
    records test accuracy every ``every`` steps against the training time so far."""
    driver.shape(rate)
    trainer = accuracy_trainer(method, work.build(), hvd.size(), lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(trainer.optimizer, T_max=steps)
    batches = work.batches(hvd.rank())
    points, elapsed = [], 0.0
    for step in range(1, steps + 1):
        inputs, targets = next(batches)
        start = time.perf_counter()
        trainer.step(inputs, targets)
        schedule.step()
        elapsed += time.perf_counter() - start
        if step % every == 0 or step == steps:
            with torch.no_grad():
                predictions = trainer.module(work.test_inputs).argmax(1)
            accuracy = (predictions == work.test_targets).float().mean().item()
            points.append((elapsed, step, accuracy))
    driver.emit("accuracy", model=work.name, method=method, rate=rate, lr=lr, points=points)


def _largest(name, value):
    """The largest of the ranks' ``value`` (``Driver``'s allreduce)."""
    return hvd.allreduce(torch.tensor([value], dtype=torch.float64), name=name, op=hvd.Max).item()


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    every = spec["methods"] + spec["accuracy"]["methods"]
    hvd.init(process_sets="dynamic" if needs_process_sets(every) else None)
    flush_subnormals()
    if needs_ddp(spec["methods"]) or needs_ddp(spec["accuracy"]["methods"]):
        init_ddp()
    driver = Driver(hvd.rank(), hvd.size(), _largest, os.path.dirname(spec_path))
    interface = os.environ.get("HOROVOD_GLOO_IFACE")
    driver.barrier()
    before = interface_bytes(interface)
    time.sleep(IDLE_SECONDS)
    tx, rx = difference(interface_bytes(interface), before, IDLE_SECONDS)
    driver.emit("idle", tx_per_second=tx, rx_per_second=rx)

    for model in spec["models"]:
        work = workload(model, hvd.rank(), hvd.size(), spec["seed"])
        batches = work.batches(spec["seed"] * 1000 + hvd.rank())
        in_nodes = spec["per_node"] > 1 and needs_process_sets(every)
        measure_bare(driver, work, spec["rates"], spec["bare_repeats"], in_nodes)
        for method in spec["methods"]:
            measure_compute(driver, work, batches, method)
            measure_method(
                driver,
                work,
                batches,
                method,
                spec["rates"],
                spec["steps"][model],
                spec["bare_repeats"],
                interface,
            )

    accuracy = spec["accuracy"]
    if hvd.size() == accuracy["workers"]:
        work = workload("cnn", hvd.rank(), hvd.size(), spec["seed"])
        for method in accuracy["methods"]:
            accuracy_curve(
                driver,
                work,
                method,
                accuracy["rate"],
                accuracy["steps"],
                accuracy["every"],
                accuracy["lr"],
            )
            gc.collect()
    driver.emit("done")


if __name__ == "__main__":
    main(sys.argv[1])
