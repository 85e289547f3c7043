"""The benchmark workers' shared protocol (``benchmarks.protocol``): how many times a
configuration is measured, decided alike on every rank."""

import itertools

from benchmarks.protocol import LONG_SECONDS, Driver


def _driver(other_ranks_seconds):
    """Rank 1's driver in a job whose other ranks measured ``other_ranks_seconds``: its
    allreduce returns the largest value, as the workers' Max-allreduce does."""
    names = []

    def largest(name, value):
        names.append(name)
        return max(value, other_ranks_seconds)

    return Driver(1, 4, largest), names


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
