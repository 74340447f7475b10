"""A compiled step's thread count timed served (thread_trial.py): the alternation, the verdict, the hold and the
intervals that do not count, on a clock the test moves; the engine's counts wired to it; and a compiled engine that
runs its steps on both counts with the tokens of one that never changes its count."""

from __future__ import annotations

import pytest
import torch

from linserve.server.engine.cpu_contention import ThreadCounts
from linserve.server.engine.cpu_threads import ThreadPlan
from linserve.server.engine.thread_trial import HOLD_FACTOR, MAX_HOLD_S, STALE_S, ThreadTrials
from linserve.server.engine.types import SamplingParams
from tests.helpers import prompt, run, tokens_of

KEY = ("decode", 1)
TRIAL = [2] * 4 + [1] * 4 + [1] * 4 + [2] * 4 + [2] * 4 + [1] * 4  # 3 blocks a count: other, default, default, …


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def steps(trials: ThreadTrials, clock: Clock, n: int, cost: dict[int, float], key=KEY, default=1, other=2) -> list:
    """`n` steps of `key` back to back, each taking `cost[count]` seconds on the count it was given."""
    counts = []
    for _ in range(n):
        count = trials.count(key, default, other)
        counts.append(count)
        clock.now += cost[count]
    return counts


def test_the_other_count_wins_when_its_steps_are_faster_and_holds_until_tried_again():
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=4, blocks=3, hold_s=5.0)
    ran = steps(trials, clock, 24, {1: 0.010, 2: 0.008})
    assert ran == TRIAL  # blocks other, default, default, other, …: a drift falls on both alike
    assert steps(trials, clock, 10, {1: 0.010, 2: 0.008}) == [2] * 10  # chosen: 2 (20% faster)
    assert trials.describe() == {"decode/1": 2}
    clock.now += max(5.0, HOLD_FACTOR * 0.216)  # the hold is over: tried again, and now 1 is faster
    ran = steps(trials, clock, 25, {1: 0.010, 2: 0.012})
    assert ran[:24] == TRIAL
    assert ran[24] == 1 and trials.describe() == {"decode/1": 1}


def test_each_trial_that_repeats_the_verdict_doubles_the_hold_and_a_changed_one_starts_it_over():
    """Half of a trial runs on the slower count: a verdict that keeps coming out the same is asked less often."""
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=4, blocks=3, hold_s=5.0)
    choice = lambda: trials.choices[(KEY, 1, 2)]  # noqa: E731
    holds = []
    for _ in range(9):
        ran = steps(trials, clock, 25, {1: 0.010, 2: 0.008})  # a whole trial (2 wins each time), then a held step
        assert ran[24] == 2
        holds.append(round(choice().until - (clock.now - 0.008), 6))  # (decided as the held step began)
        clock.now = choice().until  # the hold is over
    assert holds == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, MAX_HOLD_S, MAX_HOLD_S]
    ran = steps(trials, clock, 25, {1: 0.008, 2: 0.010})  # the host changed: 1 wins now
    assert ran[24] == 1 and choice().until - (clock.now - 0.008) == pytest.approx(5.0)
    clock.now = choice().until
    for _ in range(25):  # a trial other work broke: nothing learnt, the rule by rows and the shortest hold
        steps(trials, clock, 1, {1: 0.010, 2: 0.008})
        trials.interrupt()
    assert choice().count == 1 and choice().repeats == 0
    clock.now = choice().until
    ran = steps(trials, clock, 25, {1: 0.008, 2: 0.010})  # 1 wins again: counted from the start
    assert ran[24] == 1 and choice().until - (clock.now - 0.008) == pytest.approx(5.0)


def test_a_drift_through_the_trial_falls_on_both_counts_alike():
    """The first steps after a pause run slower (here 30% at the start, easing off linearly over the trial): with
    the blocks alternating plainly the default would hold every later place and look 3% faster than it is, enough to
    hide a count 5% faster; in the order other, default, default, other, … it does not."""
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=8, blocks=4, margin=0.03)
    ran = []
    for k in range(65):  # the trial's 64 steps, then one on the chosen count
        count = trials.count(KEY, 1, 2)
        ran.append(count)
        clock.now += 0.010 * (1 + 0.3 * max(0.0, 1 - k / 64)) * (0.95 if count == 2 else 1.0)
    assert ran[:64] == [c for c in (2, 1, 1, 2, 2, 1, 1, 2) for _ in range(8)]
    assert ran[64] == 2


def test_the_default_keeps_a_tie_within_the_margin():
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=4, blocks=3, margin=0.03)
    steps(trials, clock, 24, {1: 0.0100, 2: 0.0098})  # 2% faster: not enough
    assert steps(trials, clock, 5, {1: 0.0100, 2: 0.0098}) == [1] * 5
    trials = ThreadTrials(clock, block_steps=4, blocks=3, margin=0.03)
    steps(trials, clock, 24, {1: 0.0100, 2: 0.0096})  # 4%: enough
    assert steps(trials, clock, 5, {1: 0.0100, 2: 0.0096}) == [2] * 5


def test_a_trial_whose_intervals_other_work_broke_keeps_the_default_and_holds():
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=4, blocks=3, hold_s=5.0)
    ran = []
    for _ in range(25):  # a prefill after every step: no interval counts
        ran += steps(trials, clock, 1, {1: 0.010, 2: 0.001})
        trials.interrupt()
    assert ran == TRIAL + [1]
    assert steps(trials, clock, 40, {1: 0.010, 2: 0.001}) == [1] * 40  # held, not tried again at once


def test_each_block_s_first_interval_and_intervals_across_other_work_do_not_count():
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=4, blocks=2)
    steps(trials, clock, 8, {1: 0.010, 2: 0.005})
    trials.count(KEY, 1, 2)  # the third block's first step (count 1): the last step's interval ends here
    trial = trials.choices[(KEY, 1, 2)].trial
    assert {count: len(seen) for count, seen in trial.intervals.items()} == {2: 3, 1: 3}  # 4 steps, 3 timed each
    assert trial.intervals[2] == pytest.approx([0.005] * 3) and trial.intervals[1] == pytest.approx([0.010] * 3)
    clock.now += 5.0
    trials.interrupt()  # a prefill: the 5 s until the next step is not the block's first step's cadence
    trials.count(KEY, 1, 2)
    clock.now += 0.005
    trials.count(("verify4", 1), 1, 2)  # another program's step between two of this key's
    clock.now += 5.0
    trials.count(KEY, 1, 2)
    clock.now += 0.005
    trials.count(KEY, 1, 2)  # (one step straight after another: timed)
    assert trial.intervals[1] == pytest.approx([0.010] * 3 + [0.005]) and len(trial.intervals[2]) == 3


def test_equal_counts_need_no_trial_and_a_stale_trial_starts_over():
    clock = Clock()
    trials = ThreadTrials(clock, block_steps=4, blocks=3)
    assert steps(trials, clock, 5, {2: 0.01}, default=2, other=2) == [2] * 5 and trials.choices == {}
    steps(trials, clock, 6, {1: 0.010, 2: 0.020})
    clock.now += STALE_S + 1  # the key fell out of use mid-trial (its host was another then)
    assert steps(trials, clock, 24, {1: 0.010, 2: 0.005}) == TRIAL  # a trial from the start
    assert steps(trials, clock, 3, {1: 0.010, 2: 0.005}) == [2] * 3


def plan(**overrides) -> ThreadPlan:
    return ThreadPlan(**{"threads": 1, "usable_cpus": 2, "source": "default", "omp_wait_policy": "default",
                         "prefill_threads": 2, "kernel_threads": 2, "kernel_from_rows": 32, "adaptive": True,
                         **overrides})


def test_the_engine_s_counts_try_a_compiled_step_on_both_and_only_when_the_rule_by_rows_is_the_default():
    assert ThreadCounts(plan(kernel_from_rows=1)).trials is None  # `kernel_threads` set: every compiled step on it
    assert ThreadCounts(plan(adaptive=False)).trials is None  # `adapt_threads` off: the ceilings, fixed
    clock = Clock()
    counts = ThreadCounts(plan(), contention=None, trials=ThreadTrials(clock, block_steps=9, blocks=1))
    counts.contention = None  # (the host's own counters are not this test's business)
    before = torch.get_num_threads()
    try:
        seen = []
        for _ in range(18):
            counts.decoding(compiled=True, rows=1, key=KEY)  # narrow: `threads` by default, 2 the other
            seen.append(torch.get_num_threads())
            clock.now += 0.01 if seen[-1] == 1 else 0.005
        assert seen == [2] * 9 + [1] * 9
        counts.decoding(compiled=True, rows=1, key=KEY)
        assert torch.get_num_threads() == 2  # faster by half: chosen
        counts.decoding(compiled=False, rows=1, key=KEY)
        assert torch.get_num_threads() == 1  # an eager step: never tried
        counts.decoding(compiled=True, rows=32, key=("decode", 32))
        assert torch.get_num_threads() == 1  # wide: `kernel_threads` by default — its trial begins on the other
        trial = counts.trials.choices[(("decode", 32), 2, 1)].trial
        assert trial is not None
        for compiled in (True, False, True, True):  # an eager step (say, a verification not compiled) between two
            counts.decoding(compiled=compiled, rows=32, key=("decode", 32))
            clock.now += 5.0 if not compiled else 0.001
        assert trial.intervals[1] == pytest.approx([0.001])  # the interval across the eager step did not count
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_compiled_engine_trying_both_counts_gives_the_tokens_of_one_that_never_does(make_engine, compile_cache,
                                                                                       device):
    if device.type != "cpu":
        pytest.skip("thread counts are a CPU program's")
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=5, ignore_eos=True)
    requests = [prompt(9 + 7 * i, 40 + i) for i in range(3)]

    def compiled(**overrides):
        # (12 slots: test_batch_invariance's compiled engine builds the same bucket 1 — one build a run)
        engine = make_engine(num_slots=12, compile="on", compile_cache_dir=compile_cache, threads=1,
                             **overrides)
        engine.decode_step.sizes = [1]
        assert engine.decode_step.wait_compiled(900) and engine.decode_step.status == "compiled"
        return engine

    pinned = compiled(adapt_threads=False)
    assert pinned.runner.threads.trials is None
    want = [tokens_of(run(pinned, ids, params, f"p{i}")) for i, ids in enumerate(requests)]
    pinned.stop()
    engine = compiled()
    counts = engine.runner.threads
    if engine.threads.kernel_threads == 1:
        pytest.skip("one usable CPU: there is no second count to try")
    counts.contention = None  # (the suite's other workers would cap the counts at 1: no second count)
    trials, used = counts.trials, []
    trials.block_steps, trials.hold_s = 3, 0.0  # alternate often: every request's steps run on both counts
    choose = trials.count
    trials.count = lambda *args: used.append(choose(*args)) or used[-1]
    got = [tokens_of(run(engine, ids, params, f"t{i}")) for i, ids in enumerate(requests)]
    assert got == want
    assert set(used) == {1, engine.threads.kernel_threads}, used
    assert engine.describe_decode_step()["threads"] == trials.describe() and "decode/1" in trials.describe()
