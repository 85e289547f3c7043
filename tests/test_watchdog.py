"""The watchdog's parts in one process: its bound read from the environment, the record of
what a process waits in, the answer a peer gets on its port, the error naming every rank's
state, and the monitor that ends a wait no poll can bound. Real jobs: ``test_faults.py``."""

import socket
import time

import pytest

from hvd_compress import watchdog


@pytest.fixture
def waits(monkeypatch):
    """A fresh record in place of the process's."""
    fresh = watchdog.Waits()
    monkeypatch.setattr(watchdog, "WAITS", fresh)
    return fresh


@pytest.mark.parametrize("text, seconds", [(None, 120.0), ("2.5", 2.5), ("0", None)])
def test_the_bound_comes_from_the_environment(monkeypatch, text, seconds):
    if text is None:
        monkeypatch.delenv(watchdog.TIMEOUT_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(watchdog.TIMEOUT_VARIABLE, text)
    assert watchdog.timeout() == seconds


@pytest.mark.parametrize("text", ["-1", "soon", "inf", "nan"])
def test_a_bad_bound_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(watchdog.TIMEOUT_VARIABLE, text)
    with pytest.raises(ValueError, match="HVD_COMPRESS_TIMEOUT must be a number of seconds"):
        watchdog.timeout()


def test_a_peer_answers_what_it_waits_in_and_only_to_its_token(waits):
    address = watchdog.address()
    assert watchdog.address() is address  # one server per process
    waits.enter("allgather", "hvdc.fc.weight.codes")
    [state] = watchdog.Peers([address], rank=1).states()  # asked over TCP: not this rank
    assert (state["kind"], state["name"], state["expired"]) == (
        "allgather",
        "hvdc.fc.weight.codes",
        False,
    )
    wrong = dict(address, token="0" * 32)
    assert watchdog.Peers([wrong], rank=1).states() == [None]


def test_the_error_names_the_collective_and_the_ranks_that_did_not_arrive(waits):
    with socket.create_server(("", 0)) as closed:
        port = closed.getsockname()[1]
    gone = {"host": socket.gethostname(), "hosts": [], "port": port, "token": "x"}
    waits.enter("allreduce", "hvdc.fc.bias.scale")
    peers = watchdog.Peers([watchdog.address(), gone], rank=0)
    error = watchdog.expired("allreduce", "hvdc.fc.bias.scale", 3.0, peers)
    assert isinstance(error, watchdog.CollectiveTimeout)
    text = str(error)
    assert "the allreduce 'hvdc.fc.bias.scale' did not complete within 3 s" in text
    assert "Ranks that did not arrive: 1 (of 2; rank 0 is this one)" in text
    assert "rank 0: waiting in allreduce 'hvdc.fc.bias.scale'" in text
    assert "rank 1: no answer: exited, killed or unreachable" in text
    waits.leave(expired=True)  # a rank that gave up still counts as arrived
    assert "Ranks that did not arrive: 1 (of 2" in str(
        watchdog.expired("allreduce", "hvdc.fc.bias.scale", 3.0, peers)
    )
    assert "had not yet exchanged their states" in str(watchdog.expired("a", "b", 3.0, None))


def test_the_monitor_ends_a_wait_past_the_bound_once(monkeypatch, waits):
    monkeypatch.setenv(watchdog.TIMEOUT_VARIABLE, "0.2")
    stopped = []
    monitor = watchdog.Monitor(lambda: None, lambda: stopped.append(time.monotonic()), 0.05)
    waits.enter("gradient exchange", "hvdc.step.7")
    deadline = time.monotonic() + 10
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(stopped) == 1 and waits.expired
    assert "'hvdc.step.7' did not complete within 0.2 s" in str(monitor.error)
