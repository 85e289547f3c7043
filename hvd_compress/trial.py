"""The trial of an adaptive decision (``hvd_compress.adaptive``): the paths it chose and
the paths they would replace take turns on the running job, and the chosen paths stand only
if their steps are measurably faster.

The two sides take turns of ``TURN_STEPS`` steps, the paths on trial first, and only the
last step of a turn is timed: the first pays for the switch (a tensor that leaves its codec
sends its residuals with its allreduce; one that comes back starts with none, which skips
its compensation pass). The paths on trial stand only if their steps (the slowest rank's)
are shorter by at least ``TRIAL_MARGIN`` than the replaced paths' with significance
``TRIAL_ALPHA`` (``trial_verdict``: Wilcoxon's signed-rank test over the pairs of adjacent
turns), and fall if they are significantly not. An undecided trial goes on, ``TRIAL_TURNS``
more turns a side at a time, for as many turns as ``Adaptive.trial_seconds`` of steps take
(``trial_turns``, at most ``MAX_TRIAL_TURNS``), and then falls.

Taking turns times both sides under the same conditions: two windows of consecutive steps,
one before the decision and one after, differ by whatever changed on the machine and the
network between them, which on shared cores moved their medians by more than the margin;
and pairing adjacent turns cancels what drifts slowly. A fixed margin on the medians of a
few turns is not enough: with more ranks than cores single steps of one path spread over
3x, so a path slower by 1.4x wins a trial of three turns a side about one time in eight,
while a test of the pairs asks for evidence in proportion to the noise, and extending an
undecided trial costs little, since its sides then step alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# A trial: the paths on trial and the paths they would replace take turns, alternately, of
# TURN_STEPS steps, of which the last is timed (the first pays for the switch): TRIAL_TURNS
# turns each (TRIAL_STEPS steps), then TRIAL_TURNS more at a time while undecided
# (``trial_verdict``), up to the turns ``trial_turns`` allows, at most MAX_TRIAL_TURNS.
# TRIAL_TURNS is the fewest pairs of turns in which the signed-rank test can reach
# TRIAL_ALPHA (5 pairs all one way: 1/32).
TRIAL_TURNS = 5
MAX_TRIAL_TURNS = 25
TURN_STEPS = 2
TRIAL_STEPS = 2 * TRIAL_TURNS * TURN_STEPS
# The fraction of the replaced paths' step by which the paths on trial must be faster to
# stand: keeping the paths in force then costs at most this fraction of a step, while
# switching for less would pay the switch (and the model's risk) for a gain in the noise.
TRIAL_MARGIN = 0.05
# The significance a trial's verdict asks for, either way (``trial_verdict``): one trial
# in twenty of two paths just at the margin decides by chance, and it then costs at most
# the margin.
TRIAL_ALPHA = 0.05


def trial_turns(step_seconds: float, budget: float) -> int:
    """The most turns a side of a trial (``Adaptive.trial_seconds``): as many as fit
    ``budget`` seconds of both sides' steps of ``step_seconds`` each (0 where none was
    timed), in whole rounds of ``TRIAL_TURNS``, within ``TRIAL_TURNS`` and
    ``MAX_TRIAL_TURNS``."""
    if step_seconds <= 0:
        return TRIAL_TURNS
    turns = int(budget / (2 * TURN_STEPS * step_seconds))
    return min(max(turns - turns % TRIAL_TURNS, TRIAL_TURNS), MAX_TRIAL_TURNS)


def signed_rank_p(differences: Sequence[float]) -> float:
    """The one-sided p-value of Wilcoxon's signed-rank test that ``differences`` lean above
    0: the chance, were each as likely positive as negative, that the ranks of the positive
    ones (ranked by absolute value; zeros dropped, ties at their mean rank) sum to at least
    what they do. Exact, over every assignment of signs; 1 where every difference is 0."""
    ranked = sorted((abs(d), d > 0) for d in differences if d != 0)
    # Twice each rank, so that the mean rank of a tie stays an integer.
    weights, first = [], 0
    while first < len(ranked):
        end = first
        while end < len(ranked) and ranked[end][0] == ranked[first][0]:
            end += 1
        weights += [first + 1 + end] * (end - first)
        first = end
    observed = sum(w for w, (_, positive) in zip(weights, ranked) if positive)
    ways = [1] + [0] * sum(weights)  # ways[s]: the sign assignments whose positives sum to s
    for weight in weights:
        for total in range(len(ways) - 1, weight - 1, -1):
            ways[total] += ways[total - weight]
    return sum(ways[observed:]) / 2 ** len(weights)


def trial_verdict(replaced: Sequence[float], tried: Sequence[float]) -> bool | None:
    """Whether paths on trial stand (True), fall (False) or are undecided (None) from the
    timed steps of their turns, ``tried[i]`` next to ``replaced[i]``: they stand if each
    pair's log step ratio beyond the margin, ``log((1 - TRIAL_MARGIN) * replaced / tried)``,
    leans above 0 with significance ``TRIAL_ALPHA`` (``signed_rank_p``), fall if it leans
    below 0 so. Pairs of adjacent turns cancel what drifts slowly, and ranks rather than
    the ratios themselves weigh the pairs: a turn that waited on a descheduled rank counts
    as one pair, however long it waited."""
    gains = [math.log((1 - TRIAL_MARGIN) * r / t) for r, t in zip(replaced, tried)]
    if signed_rank_p(gains) <= TRIAL_ALPHA:
        return True
    if signed_rank_p([-g for g in gains]) <= TRIAL_ALPHA:
        return False
    return None


class Trial:
    """Paths on trial (``tried``) and the paths they would replace, taking turns of
    ``TURN_STEPS`` steps (``tried`` first), ``turns`` each until ``extend``ed, and the timed
    last step of each turn."""

    def __init__(self, tried: dict[str, str], replaced: dict[str, str], turns: int):
        self.tried, self.replaced = tried, replaced
        self.steps = 0  # the trial's length
        self.extend(turns)
        self.timed: dict[str, list[float]] = {"tried": [], "replaced": []}
        self._taken = 0  # steps of the trial taken so far

    def extend(self, turns: int) -> None:
        """``turns`` more turns a side."""
        self.steps += 2 * turns * TURN_STEPS

    @staticmethod
    def _side(step: int) -> str:
        """Whose turn step ``step`` of the trial (counted from 0) is."""
        return "replaced" if (step // TURN_STEPS) % 2 else "tried"

    def step(self, seconds: float) -> dict[str, str]:
        """Times a step of the trial that took ``seconds`` if it ended a turn; returns the
        paths of the next step."""
        if self._taken % TURN_STEPS == TURN_STEPS - 1:
            self.timed[self._side(self._taken)].append(seconds)
        self._taken += 1
        return self.replaced if self._side(self._taken) == "replaced" else self.tried
