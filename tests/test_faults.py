"""A rank that raises, dies or stalls in the middle of training: every other rank ends with
an error naming the collective and the ranks that did not arrive within the watchdog's
bound (``hvd_compress.watchdog``), or the job completes; none hangs. Ranks given different
configurations fail at their first step (``tests/test_state.py``, ``tests/test_tf_state.py``).

Each fault leaves Horovod's world broken, so each runs in a job of its own, with a bound of
``BOUND`` seconds and a hard timeout far above it: a hang fails the test, not CI.
"""

import os
import signal
import time

import pytest
import torch

from .harness import run_parallel
from .logs import record_messages

pytestmark = pytest.mark.multiprocess

BOUND = 2  # seconds: HVD_COMPRESS_TIMEOUT of these jobs
# The longest a rank whose training ended waits for the others to end theirs (``_ended``).
LINGER = 60
STEPS = 4
FAULT_STEP = 2  # the step in which the last rank fails
# A rank's step is this long; the slow rank takes SLOWER times as long.
STEP_SECONDS, SLOWER = 0.05, 10
JOB_TIMEOUT = 180  # seconds: a loaded machine traces the TensorFlow step slowly


def _ended(directory, rank, size, faulty):
    """Marks the end of this rank's training (unless it is the faulty rank) and keeps the
    rank alive, in its own code, until every rank but the faulty one has ended too (at most
    ``LINGER`` seconds). A rank that exited would end the others' waits with Horovod's error,
    before their own bounds run out: the faulty rank must be found "in no collective" rather
    than gone, and each waiting rank must end by its own bound, however far apart a loaded
    machine brings them to their waits."""
    if not faulty:
        open(os.path.join(directory, f"ended.{rank}"), "w").close()
    deadline = time.monotonic() + LINGER
    while len(os.listdir(directory)) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.1)


def _pt_fault(codec, fault, directory):
    """Trains STEPS steps; at FAULT_STEP the last rank raises (and stays alive, in its own
    code), is killed during its backward pass (collectives in flight), or sleeps SLOWER
    steps' time before each step. Returns what ended each rank's training: None (all
    steps), or the error's type and message, and the seconds from the fault to it."""
    os.environ["HVD_COMPRESS_TIMEOUT"] = str(BOUND)
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=f"{codec}:min_size=0",
    )
    rank, size = hvd.rank(), hvd.size()  # Horovod may be shut down by the time they are used
    faulty = rank == size - 1
    data = torch.Generator().manual_seed(rank)
    faulted_at = None
    try:
        for step in range(STEPS):
            time.sleep(STEP_SECONDS * (SLOWER if faulty and fault == "slow" else 1))
            optimizer.zero_grad()
            loss = model(torch.randn(16, 32, generator=data)).pow(2).mean()
            if step == FAULT_STEP:
                faulted_at = time.monotonic()
                if faulty and fault == "raises":
                    raise RuntimeError("the faulty rank's own error")
                if faulty and fault == "killed":
                    model[0].weight.register_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))
            loss.backward()
            optimizer.step()
    except Exception as error:  # noqa: BLE001 - what ended training is the result
        seconds = time.monotonic() - faulted_at
        _ended(directory, rank, size, faulty)
        return type(error).__name__, str(error), seconds
    return None, [p.detach().clone() for p in model.parameters()], time.monotonic() - faulted_at


def _fault(framework):
    return {"pytorch": _pt_fault, "tensorflow": _tf_fault}[framework]


@pytest.mark.parametrize(
    "framework, codec, np",
    [("pytorch", "ef-sign", 2), ("pytorch", "terngrad", 4), ("tensorflow", "ef-sign", 2)],
)
def test_a_rank_that_raises_ends_the_others_with_the_collective_and_the_absent_rank(
    tmp_path, framework, codec, np
):
    """The PyTorch port raises ``CollectiveTimeout``; the TensorFlow port's monitor logs
    it and shuts Horovod down, which fails the step."""
    results = run_parallel(
        _fault(framework), np, codec, "raises", str(tmp_path), own_job=True, timeout=JOB_TIMEOUT
    )
    *others, (kind, message, _) = results
    assert (kind, message) == ("RuntimeError", "the faulty rank's own error")
    for kind, message, seconds in others:
        assert kind == ("CollectiveTimeout" if framework == "pytorch" else "UnknownError")
        assert BOUND <= seconds < BOUND + 10, seconds
        assert f"did not complete within {BOUND} s (HVD_COMPRESS_TIMEOUT" in message, message
        assert f"Ranks that did not arrive: {np - 1} (of {np}" in message, message
        assert f"rank {np - 1}: in no collective of hvd_compress" in message, message
        assert "'hvdc." in message


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_rank_killed_in_a_collective_ends_the_others(tmp_path, framework):
    """Horovod's Gloo connections see the killed rank go and shut Horovod down, which
    ends the others' waits at once (``horovodrun`` and ``mpirun`` kill the others too)."""
    *others, killed = run_parallel(
        _fault(framework),
        2,
        "ef-sign",
        "killed",
        str(tmp_path),
        survivors=True,
        timeout=JOB_TIMEOUT,
    )
    assert killed is None
    for kind, message, seconds in others:
        assert kind in ("CollectiveTimeout", "HorovodInternalError", "UnknownError"), message
        assert seconds < BOUND + 10, seconds


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_rank_ten_times_slower_completes(tmp_path, framework):
    results = run_parallel(
        _fault(framework), 2, "terngrad", "slow", str(tmp_path), own_job=True, timeout=JOB_TIMEOUT
    )
    for error, params, _ in results:
        assert error is None, params
    for a, b in zip(results[0][1], results[1][1]):
        assert (a == b).all()


def _tf_fault(codec, fault, directory):
    """``_pt_fault`` for a traced step of the TensorFlow tape; a rank whose monitor ended
    the step also returns what the monitor logged."""
    os.environ["HVD_COMPRESS_TIMEOUT"] = str(BOUND)

    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tf as htf

    hvd.init()
    logged = record_messages()
    tf.keras.utils.set_random_seed(0)  # the same weights on every rank
    model = tf.keras.Sequential(
        [tf.keras.Input((32,)), tf.keras.layers.Dense(64, "relu"), tf.keras.layers.Dense(4)]
    )

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        tape = htf.DistributedGradientTape(tape, compression=f"{codec}:min_size=0")
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(0.1 * g)

    rank, size = hvd.rank(), hvd.size()  # Horovod may be shut down by the time they are used
    faulty = rank == size - 1
    data = tf.random.Generator.from_seed(rank)
    faulted_at = None
    try:
        for s in range(STEPS):
            time.sleep(STEP_SECONDS * (SLOWER if faulty and fault == "slow" else 1))
            if s == FAULT_STEP:
                faulted_at = time.monotonic()
                if faulty and fault == "raises":
                    raise RuntimeError("the faulty rank's own error")
                if faulty and fault == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
            step(data.normal((16, 32)))
    except Exception as error:  # noqa: BLE001 - what ended training is the result
        seconds = time.monotonic() - faulted_at
        _ended(directory, rank, size, faulty)
        return type(error).__name__, "\n".join(logged) or str(error), seconds
    return None, [v.numpy() for v in model.trainable_variables], time.monotonic() - faulted_at
