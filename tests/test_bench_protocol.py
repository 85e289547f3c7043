"""The benchmark workers' shared protocol (``benchmarks.protocol``): how many times a
configuration is measured, decided alike on every rank."""

import itertools
import json
import threading

import pytest

from benchmarks import protocol
from benchmarks.protocol import EVENT, LONG_SECONDS, Driver, event_of, shaped_path


def _driver(other_ranks_seconds):
    """Rank 1's driver in a job whose other ranks measured ``other_ranks_seconds``: its
    allreduce returns the largest value, as the workers' Max-allreduce does."""
    names = []

    def largest(name, value):
        names.append(name)
        return max(value, other_ranks_seconds)

    return Driver(1, 4, largest, directory=None), names


def test_a_configuration_is_measured_count_times_unless_its_first_run_is_long():
    runs = itertools.count()
    driver, _ = _driver(0.0)
    assert driver.repeated(lambda: next(runs) + 0.5, 3) == [0.5, 1.5, 2.5]
    driver, _ = _driver(0.0)
    assert driver.repeated(lambda: LONG_SECONDS, 3) == [LONG_SECONDS]
    # One rank's long first run decides for all: each run is a collective of every rank.
    driver, names = _driver(LONG_SECONDS + 1)
    assert driver.repeated(lambda: 0.1, 3) == [0.1]
    assert len(set(names)) == len(names) == 1
    # A single measurement asks nobody.
    driver, names = _driver(0.0)
    assert driver.repeated(lambda: 0.1, 1) == [0.1] and names == []


def test_short_steps_are_repeated_as_many_times_as_fit_the_budget():
    driver, _ = _driver(0.0)
    assert len(driver.repeated(lambda: 0.25, 3, 7, 1.0)) == 4
    # Never fewer than the least, never more than the most.
    driver, _ = _driver(0.0)
    assert len(driver.repeated(lambda: 0.5, 3, 7, 1.0)) == 3
    driver, _ = _driver(0.0)
    assert len(driver.repeated(lambda: 0.01, 3, 7, 1.0)) == 7
    # The slowest rank's median sets the pace of all.
    driver, names = _driver(0.5)
    assert len(driver.repeated(lambda: 0.01, 3, 7, 1.0)) == 3
    assert len(set(names)) == len(names) == 2


def test_the_pace_is_the_median_of_the_least_steps_not_the_first():
    # A slow first step (0.9 s) would allow one more step in a budget of 1 s; the median of
    # the three (0.1 s) allows ten, of which the most are seven.
    runs = iter([0.9] + [0.1] * 10)
    driver, _ = _driver(0.0)
    assert driver.repeated(lambda: next(runs), 3, 7, 1.0) == [0.9] + [0.1] * 6


def test_events_are_read_with_or_without_the_launchers_prefix():
    event = {"kind": "step", "seconds": 0.5}
    line = EVENT + json.dumps(event) + "\n"
    assert event_of(line) == event
    assert event_of("[0]<stdout>:" + line) == event
    assert event_of("[3]<stdout>:a worker's own line\n") is None
    assert event_of("Epoch 1: loss 0.3\n") is None


def test_rank_0_waits_for_the_drivers_file_before_the_barrier(tmp_path, capsys, monkeypatch):
    """Rank 0 prints a ``shape`` event and returns only once the driver's file is there;
    a driver that never answers is an error, not a hang."""
    barriers = []
    driver = Driver(0, 2, lambda name, value: barriers.append(name) or value, str(tmp_path))
    answer = threading.Timer(0.2, lambda: open(shaped_path(tmp_path, 1), "w").close())
    answer.start()
    driver.shape("1G")
    answer.join()
    assert event_of(capsys.readouterr().out) == {
        "kind": "shape",
        "workers": 2,
        "rate": "1G",
        "reply": 1,
    }
    assert len(barriers) == 1
    monkeypatch.setattr(protocol, "SHAPE_SECONDS", 0.1)
    with pytest.raises(RuntimeError, match="did not set the links to 100M"):
        driver.shape("100M")
    assert len(barriers) == 1
