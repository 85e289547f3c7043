"""The adaptive mode's timeline model and planner (``hvd_compress.adaptive``), without
Horovod's processes: exact timelines, the choices they imply, the planner's bookkeeping
and the link probes."""

import functools
import itertools
import random
import types

import pytest

from hvd_compress import TernGrad
from hvd_compress.adaptive import (
    CARRIERS,
    CHALLENGE_MARGIN,
    Adaptive,
    Link,
    PathCost,
    Planner,
    TensorTiming,
    choose,
    next_probe,
    path_traffic,
    probe_sent,
    simulate,
    uniform,
)
from hvd_compress.cost import (
    FUSION_BYTES,
    alltoall_nbytes,
    compressed_traffic,
    uncompressed_traffic,
)
from hvd_compress.trial import (
    MAX_TRIAL_TURNS,
    TRIAL_ALPHA,
    TRIAL_MARGIN,
    TRIAL_STEPS,
    TRIAL_TURNS,
    TURN_STEPS,
    signed_rank_p,
    trial_turns,
    trial_verdict,
)

MB = 1e6


def _tensor(name, ready, megabytes, codec_cpu=(0.0, 0.0), ratio=16):
    """A tensor whose fp32 allreduce sends ``megabytes``; fp16 half of it, the codec
    1/``ratio`` of it in two rounds, at ``codec_cpu`` seconds before and after."""
    sent = megabytes * MB
    return TensorTiming(
        name,
        ready,
        {
            "fp32": PathCost(0.0, 0.0, sent, 1, "fp32"),
            "fp16": PathCost(0.001, 0.001, sent / 2, 1, "fp16"),
            "codec": PathCost(codec_cpu[0], codec_cpu[1], sent / ratio, 2, "bytes"),
        },
    )


def _links(latency, seconds_per_byte):
    """The same link for every carrier."""
    return dict.fromkeys(CARRIERS, Link(latency, seconds_per_byte))


def test_link_fit_recovers_latency_and_bandwidth():
    link = Link.fit((4e3, 1e-3 + 4e3 / 1e8), (1e6, 1e-3 + 1e6 / 1e8))
    assert link.latency == pytest.approx(1e-3)
    assert link.seconds_per_byte == pytest.approx(1e-8)
    # Noise that makes the larger probe faster gives an infinitely fast link, not a negative one.
    assert Link.fit((4e3, 2e-3), (1e6, 1e-3)) == Link(2e-3, 0.0)


def test_simulate_is_the_timeline_by_hand():
    links = _links(latency=0.01, seconds_per_byte=1e-8)  # 100 MB/s
    tensors = [_tensor("a", 0.0, 1, codec_cpu=(0.02, 0.03)), _tensor("b", 0.05, 2)]
    # a: encode 0.02 delays b; two rounds on the idle link 0.02, then 0.01 / 16 -> a done
    # at 0.040625. b (fp32): ready 0.05 + 0.02 = 0.07, link idle; 0.01 + 0.02 -> 0.10.
    # After the backward (0.07): a decodes at max(0.07, 0.040625) + 0.03 = 0.10; b at 0.10.
    assert simulate(tensors, {"a": "codec", "b": "fp32"}, links) == pytest.approx(0.10)
    # Contention doubles every CPU second: a's encode (0.04) moves b to 0.09, and a decodes
    # for 0.06 after the backward ends there.
    assert simulate(tensors, {"a": "codec", "b": "fp32"}, links, contention=2.0) == pytest.approx(
        0.09 + 0.06
    )


def test_a_collective_queued_behind_another_pays_no_latency():
    links = _links(latency=0.01, seconds_per_byte=1e-8)
    both = [_tensor("a", 0.0, 1), _tensor("b", 0.0, 1)]
    # a: 0.01 + 0.01; b waits for the link and only adds its bytes.
    assert simulate(both, {"a": "fp32", "b": "fp32"}, links) == pytest.approx(0.03)
    # Carriers differ: the same bytes over an fp16 link twice as slow per byte.
    slow_fp16 = dict(links, fp16=Link(0.01, 4e-8))
    assert simulate(both[:1], {"a": "fp16"}, slow_fp16) == pytest.approx(0.01 + 0.02 + 0.002)


def test_fast_link_keeps_fp32_and_slow_link_compresses():
    tensors = [_tensor(f"t{i}", 0.01 * i, 4, codec_cpu=(0.004, 0.004)) for i in range(6)]
    fast = _links(latency=1e-4, seconds_per_byte=1 / 1.25e9)  # 10 Gbit/s
    slow = _links(latency=1e-3, seconds_per_byte=1 / 12.5e6)  # 100 Mbit/s
    assert set(choose(tensors, fast).values()) == {"fp32"}
    assert set(choose(tensors, slow).values()) == {"codec"}
    for link in (fast, slow):
        chosen = simulate(tensors, choose(tensors, link), link)
        assert chosen <= min(
            simulate(tensors, uniform(tensors, p), link) for p in ("codec", "fp16", "fp32")
        )


def test_codec_slower_than_the_bytes_it_saves_is_declined():
    links = _links(latency=1e-4, seconds_per_byte=1 / 125e6)  # 1 Gbit/s: 4 MB in 32 ms
    tensors = [_tensor("t", 0.0, 4, codec_cpu=(0.05, 0.05))]
    assert choose(tensors, links) == {"t": "fp16"}
    # Where Horovod sums fp16 four times slower per byte than fp32, fp32 wins.
    assert choose(tensors, dict(links, fp16=Link(1e-4, 8 / 125e6))) == {"t": "fp32"}


def test_pins_are_kept_and_ties_go_to_the_simpler_path():
    links = _links(latency=0.0, seconds_per_byte=0.0)  # no network: paths cost their CPU
    tensors = [_tensor("a", 0.0, 1), _tensor("b", 0.0, 1)]
    assert choose(tensors, links, pin={"b": "codec"}) == {"a": "fp32", "b": "codec"}


def test_path_traffic_is_the_cost_model():
    codec = TernGrad(min_size=0)
    traffic = path_traffic(codec, 100_000, 4, "sharded")
    assert traffic["fp32"] == (uncompressed_traffic(100_000, 4).sent, 1, "fp32")
    assert traffic["fp16"] == (uncompressed_traffic(100_000, 4, 2).sent, 1, "fp16")
    # The shared scale's Max-allreduce, and the alltoall and allgather, of packed bytes,
    # whose rounds the tensor shares with the others of its fusion group by its bytes.
    share = alltoall_nbytes(codec, 100_000, 4) / FUSION_BYTES
    assert 0 < share < 1
    assert traffic["codec"] == (
        compressed_traffic(codec, 100_000, 4, "sharded").sent,
        1 + 2 * share,
        "bytes",
    )
    # Summed ternary values of 4 workers fit fp16's exact integers: the fp16 carrier.
    assert path_traffic(codec, 100_000, 4, "allreduce")["codec"][1:] == (2, "fp16")


def test_probes_grow_until_the_bandwidth_shows():
    assert next_probe(1 << 20, 0.002) == 4 << 20
    assert next_probe(4 << 20, 0.03) is None  # long enough
    assert next_probe(16 << 20, 0.001) is None  # the largest
    assert probe_sent("bytes", 1000, 4) == 3000  # an allgather sends N - 1 copies
    assert probe_sent("fp16", 1000, 4) == uncompressed_traffic(500, 4, 2).sent


def test_a_burst_of_noise_falls_on_every_carrier_alike(monkeypatch):
    """The PyTorch pipeline's probes (``AdaptiveSteps._probe_links``) with Horovod's collectives
    replaced by a clock: each takes 1 ms, but the first five after the ranks meet take
    20 ms more (a rank descheduled). The carriers' probes take turns, so every carrier
    keeps fast repeats and all fit the same latency; five repeats of one carrier in a row
    would have made that carrier alone 20 ms slower."""
    from hvd_compress.pt import adaptive as steps

    clock = {"now": 0.0, "calls": 0}

    def collective(*args, **kwargs):
        clock["calls"] += 1
        clock["now"] += 1e-3 + (20e-3 if clock["calls"] <= 5 else 0.0)

    def arrive(*args, name, **kwargs):
        if name == "hvdc.adaptive.arrive":
            clock["calls"] = 0
        else:
            collective()

    monkeypatch.setattr(steps, "allreduce_async_", arrive)
    monkeypatch.setattr(steps, "allgather_async", collective)
    monkeypatch.setattr(steps, "wait", lambda handle, spin=False: None)
    monkeypatch.setattr(steps.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(steps, "max_over_ranks", lambda values, name, ranks: values)
    probes = types.SimpleNamespace(process_set=None, world_size=2)
    probes._probe = functools.partial(steps.AdaptiveSteps._probe, probes)
    links = steps.AdaptiveSteps._probe_links(probes, "cpu")
    assert set(links) == set(CARRIERS)
    for link in links.values():
        assert link.latency == pytest.approx(1e-3)


def test_planner_warms_up_decides_and_redecides():
    planner = Planner(Adaptive(warmup_steps=2, every=3, pin={"b": "fp32"}), ["a", "b"])
    assert planner.paths == {"a": "codec", "b": "fp32"}
    assert [planner.due(step) for step in range(1, 3)] == [False, True]
    assert planner.start_step(0)
    planner.ready_at("b", 0.0)
    planner.spent("b", "before", 0.001, wall=0.002)
    planner.ready_at("a", 0.011)  # 0.01 of backward after b's 0.001 of work
    planner.spent("a", "before", 0.002, wall=0.004)
    planner.spent("a", "after", 0.003, wall=0.5)  # waits too: not a measure of contention
    planner.end_step(0.1)
    assert planner.ready == {"b": 0.0, "a": pytest.approx(0.01)}
    assert planner.cpu[("a", "codec", "after")] == 0.003
    assert planner.contention == pytest.approx(2.0)
    measured = planner.measurements()
    # The contention, the step; a: ready, codec before/after measured, fp16 not; b: ready,
    # and fp32 does no codec work.
    assert measured == [
        pytest.approx(2.0),
        0.1,
        pytest.approx(0.01),
        0.002,
        0.003,
        -1.0,
        -1.0,
        0.0,
        -1,
        -1,
        -1,
        -1,
    ]
    traffic = {
        name: {
            "fp32": (4 * MB, 1, "fp32"),
            "fp16": (2 * MB, 1, "fp16"),
            "codec": (MB / 4, 2, "bytes"),
        }
        for name in "ab"
    }
    timings, contention, step_seconds = planner.timings(measured, traffic)
    assert contention == pytest.approx(2.0) and step_seconds == 0.1
    assert [t.name for t in timings] == ["b", "a"]  # in the order they became ready
    assert set(timings[1].costs) == {"fp32", "codec"} and set(timings[0].costs) == {"fp32"}
    decision = planner.decide(2, timings, _links(1e-3, 1 / 12.5e6), 1.0, step_seconds)
    assert decision.paths == {"a": "codec", "b": "fp32"}
    assert decision.predicted["chosen"] <= decision.predicted["fp32"]
    # fp32 everywhere, predicted within CHALLENGE_MARGIN of the codec, challenges it,
    # judged after TRIAL_TURNS turns a side, then while undecided for at most as many as
    # 0.1 s steps fill in the default 60 s: 25 a side, the most.
    assert decision.challenger == "fp32" and planner.judging
    assert decision.trial_turns == planner.report()["trial_turns"] == MAX_TRIAL_TURNS
    assert planner.due(2 + TRIAL_STEPS) and not planner.due(1 + TRIAL_STEPS)
    planner.restart(7)
    assert planner.paths == {"a": "codec", "b": "fp32"} and planner.due(9)


def test_only_the_steps_before_a_decision_are_measured():
    planner = Planner(Adaptive(warmup_steps=2, every=10), ["a"])
    measured = []
    for step in range(14):
        measured.append(planner.start_step(step))
        planner.spent("a", "before", 0.002 if measured[-1] else 0.001, wall=0.002)
        planner.end_step(0.1)
        if planner.due(step + 1):
            planner.decide(step + 1, [_tensor("a", 0.0, 1, (0.002, 0.0))], _links(*SLOW), 1.0)
    # The warm-up (0, 1), then the two steps before the decision after step 11.
    assert [step for step, m in enumerate(measured) if m] == [0, 1, 10, 11]
    assert planner.cpu[("a", "codec", "before")] == 0.002  # unmeasured steps add nothing
    never_again = Planner(Adaptive(warmup_steps=1, every=0), ["a"])
    assert never_again.start_step(0)
    never_again.end_step(0.1)
    never_again.decide(1, [_tensor("a", 0.0, 1, (0.002, 0.0))], _links(*SLOW), 1.0)
    assert not never_again.start_step(1)


def _decide_on(planner, step, link):
    """A decision over tensors "a" and "b" (100 MB each, a codec of 4 ms a side) on
    ``link``: fp32 everywhere when it is fast, the codec when it is slow."""
    tensors = [_tensor(name, 0.0, 100, codec_cpu=(0.004, 0.004)) for name in "ab"]
    return planner.decide(step, tensors, _links(*link), 1.0)


FAST, SLOW = (1e-5, 1 / 125e9), (1e-4, 1 / 12.5e6)
# 40 Gbit/s: the codec predicted 16 ms, fp16 22 ms (within CHALLENGE_MARGIN), fp32 40 ms.
NEAR = (1e-4, 8 / 40e9)
# 100 Gbit/s: fp16 predicted 10 ms, the codec and fp32 16 ms (both within the margin).
THIRD = (1e-4, 8 / 100e9)


def _trial(planner, seconds, turns=TRIAL_TURNS):
    """Runs ``turns`` turns a side of the trial under way, each step taking ``seconds`` of
    the path that tensor "a" takes (a number, or a function of the turn, counted from 0 on
    each side), but the first of every turn, which pays for the switch and takes a second;
    returns a's path at each step. No step of a trial is measured."""
    taken = []
    for step in range(2 * turns * TURN_STEPS):
        assert not planner.start_step(planner.next_decision - 1)
        taken.append(planner.paths["a"])
        took = seconds[taken[-1]]
        took = took(step // (2 * TURN_STEPS)) if callable(took) else took
        planner.end_step(1.0 if step % TURN_STEPS == 0 else took)
    return taken


def _turns(tried, replaced, turns=TRIAL_TURNS):
    """The paths of a trial's steps: ``tried`` and ``replaced`` taking ``turns`` turns."""
    return ([tried] * TURN_STEPS + [replaced] * TURN_STEPS) * turns


@pytest.mark.parametrize(
    "trial_seconds, kept",
    [(0.09, True), (0.096, False), (0.1, False), (0.11, False)],
)
def test_a_decision_that_changes_paths_stands_only_if_its_steps_are_faster_by_the_margin(
    trial_seconds, kept
):
    assert TRIAL_MARGIN == 0.05  # the cases sit on both sides of 0.1 * (1 - TRIAL_MARGIN)
    planner = Planner(Adaptive(warmup_steps=3, every=10), ["a", "b"])
    decision = _decide_on(planner, 3, FAST)
    assert planner.paths == {"a": "fp32", "b": "fp32"} and planner.judging
    assert planner.due(3 + TRIAL_STEPS) and not planner.due(2 + TRIAL_STEPS)
    taken = _trial(planner, {"fp32": trial_seconds, "codec": 0.1})
    assert taken == _turns("fp32", "codec")
    # The last step of each turn, TRIAL_TURNS a side: the replaced paths', then the tried.
    assert planner.trial_seconds() == pytest.approx(
        [0.1] * TRIAL_TURNS + [trial_seconds] * TRIAL_TURNS
    )
    assert planner.judge(3 + TRIAL_STEPS, planner.trial_seconds()) is kept
    assert not planner.judging and decision.trial["kept"] is kept
    assert planner.paths == dict.fromkeys("ab", "fp32" if kept else "codec")
    assert planner.report()["trial"] == decision.trial
    assert planner.verdict().startswith(f"{'kept' if kept else 'reverted'} after 5 turns a side")
    # Counted from the judgement; a decision that changes nothing is not tried.
    judged = 3 + TRIAL_STEPS
    assert planner.next_decision == judged + 10
    planner.end_step(0.1)
    _decide_on(planner, judged + 10, FAST if kept else SLOW)
    assert not planner.judging and planner.next_decision == judged + 20


def test_trials_may_take_more_turns_where_steps_are_short():
    # As many turns of two steps a side as both sides' steps fit in the budget, in rounds
    # of TRIAL_TURNS; the least where no step was timed or the budget is 0.
    assert [trial_turns(s, 30.0) for s in (0.0, 2.0, 0.75, 0.5, 0.3, 0.01)] == [
        TRIAL_TURNS,
        TRIAL_TURNS,
        10,
        15,
        MAX_TRIAL_TURNS,
        MAX_TRIAL_TURNS,
    ]
    assert trial_turns(0.001, 0.0) == TRIAL_TURNS
    assert all(trial_turns(s / 1000, 30.0) % TRIAL_TURNS == 0 for s in range(1, 3000))
    assert Adaptive(trial_seconds=0).trial_seconds == 0.0


def _fp32_on_trial(step_seconds):
    """A planner whose decision after step 3 (fp32 on tensors "a" and "b", on a fast link)
    is on trial against the codec, after measured steps of ``step_seconds``."""
    planner = Planner(Adaptive(warmup_steps=3, every=10), ["a", "b"])
    tensors = [_tensor(name, 0.0, 100, codec_cpu=(0.004, 0.004)) for name in "ab"]
    planner.decide(3, tensors, _links(*FAST), 1.0, step_seconds=step_seconds)
    assert planner.paths == dict.fromkeys("ab", "fp32") and planner.judging
    return planner


def test_an_undecided_trial_goes_on_for_the_turns_its_steps_allow():
    # Steps of 1 s: at most 15 turns a side. fp32 steps 10% faster but for a slow first
    # turn: undecided after 5 turns, it stands after 10.
    planner = _fp32_on_trial(1.0)
    assert planner.decision.trial_turns == 15
    slow = {0}
    fp32 = {"fp32": lambda turn: 5.0 if turn in slow else 0.45, "codec": 0.5}
    judged = 3
    for verdict in (None, True):
        assert _trial(planner, fp32) == _turns("fp32", "codec")
        slow.clear()
        judged += TRIAL_STEPS
        assert planner.due(judged) and not planner.due(judged - 1)
        assert planner.judge(judged, planner.trial_seconds()) is verdict
        if verdict is None:
            assert planner.judging and planner.paths == dict.fromkeys("ab", "fp32")
            assert planner.verdict() == (
                "undecided after 5 turns a side, 5 more: 450.0 ms a step against 500.0 ms "
                "under the paths it replaced"
            )
    assert planner.decision.trial == {
        "replaced_seconds": 0.5,
        "seconds": 0.45,
        "turns": 10,
        "kept": True,
    }
    assert planner.verdict().startswith("kept after 10 turns a side")
    # Sides just at the margin, each turn 1.2x off it either way, never decide: after 15
    # turns the replaced paths come back.
    planner = _fp32_on_trial(1.0)
    at_margin = (1 - TRIAL_MARGIN) * 0.5
    alike = {"fp32": lambda turn: at_margin * 1.2 ** (-1) ** turn, "codec": 0.5}
    verdicts = []
    while planner.judging and planner.decision.challenger is None:
        _trial(planner, alike)
        verdicts.append(planner.judge(planner.next_decision, planner.trial_seconds()))
    assert verdicts == [None, None, False]
    assert planner.decision.trial["turns"] == 15
    assert planner.paths != dict.fromkeys("ab", "fp32")


def test_trials_decide_right_under_the_noise_of_shared_cores():
    # Timed steps that spread over 3x from one to the next, as with 4 ranks on 2 cores: of
    # 200 trials of steps of 0.5 s (at most 25 turns a side), a path 1.4x slower than the
    # codec stands in at most TRIAL_ALPHA of them, one 1.4x faster in most.
    noise = random.Random(0)

    def stood(ratio):
        planner = _fp32_on_trial(0.5)
        seconds = {
            "fp32": lambda _: 0.5 * ratio * noise.uniform(0.6, 1.8),
            "codec": lambda _: 0.5 * noise.uniform(0.6, 1.8),
        }
        while True:
            _trial(planner, seconds)
            verdict = planner.judge(planner.next_decision, planner.trial_seconds())
            if verdict is not None:
                return verdict

    assert sum(stood(1.4) for _ in range(200)) <= TRIAL_ALPHA * 200
    assert sum(stood(1 / 1.4) for _ in range(200)) >= 0.85 * 200


def test_signed_rank_p_is_the_share_of_sign_assignments_as_extreme():
    # The exact one-sided p-value, by enumerating every assignment of signs to the ranks.
    def by_enumeration(differences):
        nonzero = [d for d in differences if d]
        ranks = [
            1
            + sum(abs(e) < abs(d) for e in nonzero)
            + (sum(abs(e) == abs(d) for e in nonzero) - 1) / 2
            for d in nonzero
        ]
        observed = sum(r for r, d in zip(ranks, nonzero) if d > 0)
        sums = [
            sum(r for r, positive in zip(ranks, signs) if positive)
            for signs in itertools.product((False, True), repeat=len(ranks))
        ]
        return sum(total >= observed for total in sums) / len(sums)

    cases = [
        [0.1] * 5,
        [1, 2, 3, -4, 5],
        [1, -1, 2, 2, -3, 0, 4],
        [0.5, -0.2, 0.3, -0.4, 0.1, 0.6, -0.7, 0.8],
        [0.0, 0.0],
    ]
    for differences in cases:
        assert signed_rank_p(differences) == pytest.approx(
            by_enumeration(differences) if any(differences) else 1.0
        )
    assert signed_rank_p([0.1] * 5) == 1 / 32 <= TRIAL_ALPHA < signed_rank_p([0.1] * 4)
    assert trial_verdict([1.0] * 5, [0.9] * 5) is True
    assert trial_verdict([1.0] * 5, [0.96] * 5) is False  # faster, but not by the margin
    assert trial_verdict([1.0] * 4, [0.5] * 4) is None  # four pairs decide nothing


def test_a_trial_times_both_sides_under_the_same_drift():
    # Every step 10 ms slower than the one before: two windows, one after the other, would
    # make the later paths look 30 ms slower; turns put each pair within one turn's drift.
    planner = Planner(Adaptive(warmup_steps=3, every=10), ["a", "b"])
    _decide_on(planner, 3, FAST)
    for step in range(TRIAL_STEPS):
        planner.end_step(0.1 + 0.01 * step)
    timed = planner.trial_seconds()
    replaced, tried = timed[:TRIAL_TURNS], timed[TRIAL_TURNS:]
    assert [r - t for r, t in zip(replaced, tried)] == pytest.approx([0.01 * TURN_STEPS] * 5)


@pytest.mark.parametrize("trial_seconds, kept", [(0.09, True), (0.1, False)])
def test_a_decision_that_keeps_the_paths_is_challenged_by_the_nearest_single_path(
    trial_seconds, kept
):
    planner = Planner(Adaptive(warmup_steps=3, every=10), ["a", "b"])
    decision = _decide_on(planner, 3, NEAR)
    assert decision.paths == dict.fromkeys("ab", "codec")  # the warm-up's paths, kept
    assert decision.predicted["fp16"] <= CHALLENGE_MARGIN * decision.predicted["chosen"]
    assert decision.predicted["fp32"] > CHALLENGE_MARGIN * decision.predicted["chosen"]
    assert decision.challenger == "fp16" and planner.judging
    assert planner.paths == dict.fromkeys("ab", "fp16")
    assert _trial(planner, {"fp16": trial_seconds, "codec": 0.1}) == _turns("fp16", "codec")
    assert planner.judge(3 + TRIAL_STEPS, planner.trial_seconds()) is kept
    assert planner.paths == dict.fromkeys("ab", "fp16" if kept else "codec")
    assert not planner.judging and decision.trial is None
    assert planner.report()["challenger"] == "fp16" and decision.challenge["kept"] is kept
    assert planner.verdict().startswith(
        f"challenger every tensor by fp16 {'stood' if kept else 'fell'}"
    )
    # Every single path predicted beyond the margin: nothing is tried.
    beyond = Planner(Adaptive(warmup_steps=3, every=10), ["a", "b"])
    decision = _decide_on(beyond, 3, SLOW)
    assert decision.challenger is None and not beyond.judging
    assert beyond.paths == dict.fromkeys("ab", "codec")


@pytest.mark.parametrize("challenge_seconds, stood", [(0.09, True), (0.1, False)])
def test_a_decision_whose_trial_falls_is_challenged_by_a_third_path(challenge_seconds, stood):
    planner = Planner(Adaptive(warmup_steps=3, every=10), ["a", "b"])
    decision = _decide_on(planner, 3, THIRD)
    assert planner.paths == dict.fromkeys("ab", "fp16") and decision.challenger is None
    _trial(planner, {"fp16": 0.2, "codec": 0.1})
    judged = 3 + TRIAL_STEPS
    assert planner.judge(judged, planner.trial_seconds()) is False
    # Neither the paths in force (the codec) nor the decision's (fp16) again: fp32.
    assert decision.challenger == "fp32" and planner.judging
    assert planner.paths == dict.fromkeys("ab", "fp32")
    assert planner.verdict() == (
        "reverted after 5 turns a side: 200.0 ms a step against 100.0 ms under the paths it "
        "replaced; "
        "every tensor by fp32 on trial against them"
    )
    assert planner.due(judged + TRIAL_STEPS) and not planner.due(judged + TRIAL_STEPS - 1)
    # Against the paths in force before the decision, timed again beside it.
    taken = _trial(planner, {"fp32": challenge_seconds, "codec": 0.1})
    assert taken == _turns("fp32", "codec")
    assert planner.trial_seconds() == pytest.approx(
        [0.1] * TRIAL_TURNS + [challenge_seconds] * TRIAL_TURNS
    )
    assert planner.judge(judged + TRIAL_STEPS, planner.trial_seconds()) is stood
    assert not planner.judging and planner.next_decision == judged + TRIAL_STEPS + 10
    assert planner.paths == dict.fromkeys("ab", "fp32" if stood else "codec")
    report = planner.report()
    assert report["trial"]["kept"] is False and report["challenge"]["kept"] is stood
    assert planner.verdict().startswith(
        f"challenger every tensor by fp32 {'stood' if stood else 'fell'}"
    )


def test_every_zero_decides_once():
    planner = Planner(Adaptive(warmup_steps=1, every=0), ["a"])
    planner.decide(1, [_tensor("a", 0.0, 1, (0.002, 0.0))], _links(*SLOW), 1.0)
    assert not planner.judging
    assert not any(planner.due(step) for step in range(100))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(warmup_steps=0), "Adaptive: warmup_steps must be >= 1, got 0"),
        (dict(every=-1), "Adaptive: every must be >= 0, got -1"),
        (dict(pin={"a": "int8"}), "pin maps parameter names to one of"),
        (dict(trial_seconds=-1.0), "Adaptive: trial_seconds must be >= 0"),
    ],
)
def test_bad_options_name_the_parameter(options, message):
    with pytest.raises(ValueError, match=message):
        Adaptive(**options)


def test_pins_of_tensors_sent_whole_are_refused():
    with pytest.raises(ValueError, match="sends whole whatever the mode: \\['bias'\\]"):
        Planner(Adaptive(pin={"bias": "fp16"}), ["weight"])
    with pytest.raises(TypeError, match="adaptive must be True, False or an"):
        Adaptive.of("yes")


def test_a_mix_of_paths_must_be_clearly_faster_than_one_path():
    links = _links(latency=1e-4, seconds_per_byte=1 / 12.5e6)  # 100 Mbit/s
    # Large and cheap to compress, then small with a codec that costs more than its bytes.
    big = _tensor("big", 0.0, 40, codec_cpu=(0.01, 0.01))
    small = _tensor("small", 0.0, 0.1, codec_cpu=(0.1, 0.1))
    mixed = {"big": "codec", "small": "fp32"}
    assert simulate([big, small], mixed, links) < simulate(
        [big, small], uniform([big, small], "codec"), links
    )
    # The mix saves 0.2 s of 0.42 s: taken. Where the small tensor's codec costs 0.05 s a
    # side, the mix would save 0.05 s of 0.27 s (18%): one path.
    assert choose([big, small], links) == mixed
    cheaper_small = _tensor("small", 0.0, 0.1, codec_cpu=(0.05, 0.05))
    assert simulate([big, cheaper_small], mixed, links) < simulate(
        [big, cheaper_small], uniform([big, cheaper_small], "codec"), links
    )
    assert choose([big, cheaper_small], links) == {"big": "codec", "small": "codec"}
