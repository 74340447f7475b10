"""Who writes a step's outboxes (server/engine_process/write_handoff.py): both writers timed by the engine's decode
cadence, in alternating blocks; the outboxes' thread only where it is faster by the margin; tried again later."""

from __future__ import annotations

import pytest

from linserve.server.engine_process import write_handoff
from linserve.server.engine_process.write_handoff import WriteHandoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(handoff: WriteHandoff, clock: Clock, steps: int, thread_s: float, engine_s: float,
        writer: bool | None = None) -> list[bool]:
    """`steps` decode steps, each taking what its writer costs (the writer chosen at the last step's end)."""
    writers = []
    for _ in range(steps):
        clock.now += (thread_s if writer else engine_s) if writer is not None else engine_s
        writer = handoff.step_ended(True)
        writers.append(writer)
    return writers


def trial_steps(handoff: WriteHandoff) -> int:
    return handoff.block_steps * len(handoff.order)


@pytest.mark.parametrize("thread_s, engine_s, handed_off", [(400e-6, 500e-6, True), (500e-6, 400e-6, False),
                                                            (495e-6, 500e-6, False)],
                         ids=["thread-faster", "engine-faster", "within-the-margin"])
def test_a_trial_times_both_writers_in_alternating_blocks_and_keeps_the_faster(thread_s, engine_s, handed_off):
    clock = Clock()
    handoff = WriteHandoff(clock=clock)
    writers = run(handoff, clock, trial_steps(handoff), thread_s, engine_s)
    blocks = [writers[i:i + handoff.block_steps] for i in range(0, len(writers), handoff.block_steps)]
    assert [block[0] for block in blocks] == list(handoff.order)  # (thread first: other, default, default, other…)
    assert all(len(set(block)) == 1 for block in blocks)
    assert not handoff.handed_off and handoff.trials == 0  # (decided on the whole trial: the engine writes until then)
    assert run(handoff, clock, 1, thread_s, engine_s, writers[-1]) == [handed_off]
    assert handoff.handed_off is handed_off and handoff.trials == 1
    assert set(run(handoff, clock, 100, thread_s, engine_s, handed_off)) == {handed_off}  # (held)


def test_intervals_with_other_work_in_them_do_not_count():
    clock = Clock()
    handoff = WriteHandoff(clock=clock)
    writer = None
    for step in range(trial_steps(handoff) + 1):
        clock.now += 500e-6 if not writer else 400e-6  # (the thread faster per step ...)
        if writer and step % 2:  # (... but a prefill of 50 ms ends between half its steps, and a batch of commands)
            clock.now += 50e-3
            assert handoff.step_ended(False) is True  # (the block's writer)
            assert handoff.step_ended(False) is True
        writer = handoff.step_ended(True)
    assert handoff.handed_off


def test_a_verdict_holds_for_its_steps_then_a_trial_runs_again_and_a_stale_one_starts_over(monkeypatch):
    monkeypatch.setattr(write_handoff, "MIN_INTERVALS", 2)
    clock = Clock()
    handoff = WriteHandoff(clock=clock, block_steps=4, blocks=2, hold_steps=50)
    writers = run(handoff, clock, trial_steps(handoff) + 1, 400e-6, 500e-6)
    assert handoff.handed_off and handoff.trials == 1
    assert set(run(handoff, clock, 49, 400e-6, 500e-6, writers[-1])) == {True}
    writers = run(handoff, clock, trial_steps(handoff), 600e-6, 500e-6, True)  # (the host changed: now slower)
    assert writers[:4] == [True] * 4 and writers[4:8] == [False] * 4
    assert run(handoff, clock, 1, 600e-6, 500e-6, writers[-1]) == [False]
    assert handoff.trials == 2 and not handoff.handed_off

    handoff = WriteHandoff(clock=clock, block_steps=4, blocks=2)
    run(handoff, clock, 6, 400e-6, 500e-6)  # (half a trial, then the engine idles)
    clock.now += write_handoff.STALE_S + 1
    writers = run(handoff, clock, trial_steps(handoff), 400e-6, 500e-6)
    assert writers[:4] == [True] * 4  # (started over: the first block again)
    assert handoff.trials == 0


def test_a_trial_broken_throughout_keeps_the_last_verdict():
    clock = Clock()
    handoff = WriteHandoff(clock=clock)
    for _ in range(trial_steps(handoff) + 1):
        clock.now += 400e-6
        handoff.step_ended(False)  # (a command batch between every two steps: no interval counts)
        handoff.step_ended(True)
    assert handoff.trials == 1 and not handoff.handed_off
