"""Who writes a step's outboxes to the frontends — the engine thread, or the outboxes' thread — chosen by timing the
engine's steps both ways, served.

A write on a Unix socket wakes its reader as a synchronous wake-up, which Linux places on the writer's CPU and lets
preempt: the frontend (and what it wakes in turn) runs where the engine thread was about to go on — a one-stream
step's write took the engine thread a median 210–340 µs on a 2-vCPU Xeon VM, ~16 µs on a Zen 5. Handed to the
outboxes' thread, the write overlaps the next step's program, which runs without the GIL; but that thread needs the
GIL to pickle and write, and each hand-over of the GIL between it and the engine thread is a futex wake-up and a wait
on the engine thread's path (py-spy over the core on the 2-vCPU Zen 3 at one stream: ~30 µs of a ~570 µs step
waiting for the GIL, ~12 µs signalling it). Which costs the engine more depends on the host and the load, and the
write's own time cannot say: timed alone it chose the thread on both 2-vCPU hosts, rightly on the Xeon (1.14× at
one stream) and wrongly on the Zen 3 (the engine thread writing served one stream 1,659–1,780 tokens/s, handed off
1,074–1,691, four rounds alternating; docs/benchmarks.md).

So the writers are compared by what they cost the engine: its *cadence*, from one decode step's end to the next's
(the interval holds the step, the engine's loop and — when the engine thread writes — the last step's write). A trial
runs BLOCKS blocks of BLOCK_STEPS decode steps on each writer, in thread_trial.block_order's order (a drift of the
host's speed falls on both alike; 24 steps, not the thread trials' 32, so the two trials' blocks do not line up:
started together, each writer's steps fall half in the thread trial's blocks of either count), drops each block's
first interval (the writer just changed), and hands off only when the thread's median is faster by MARGIN. A
verdict holds for HOLD_STEPS decode steps, then the next trial starts; a trial whose steps stopped for STALE_S starts
over. An interval with anything else in it — a prefill, a batch of commands — does not count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..engine.thread_trial import Trial, block_order, faster

logger = logging.getLogger("linserve.server.engine_process")

BLOCK_STEPS = 24  # decode steps a block runs with one writer
BLOCKS = 4  # blocks each writer runs in a trial
MARGIN = 0.03  # the outboxes' thread must be this much faster (its median cadence) to write
HOLD_STEPS = 8192  # decode steps a verdict holds before the next trial
STALE_S = 10.0  # a trial that saw no decode step for this long starts over
MIN_INTERVALS = 8  # a verdict needs this many intervals of each writer (else the last verdict holds)


class WriteHandoff:
    """`step_ended(decode)` at each step's (or batch of commands') end, on the engine thread: whether the outboxes'
    thread writes its events (True) or the engine thread does (False)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, block_steps: int = BLOCK_STEPS,
                 blocks: int = BLOCKS, hold_steps: int = HOLD_STEPS) -> None:
        self.clock, self.block_steps, self.blocks, self.hold_steps = clock, block_steps, blocks, hold_steps
        self.handed_off = False  # the verdict in force between trials (the engine thread writes until one ends)
        self.trials = 0  # trials concluded
        self.trial: Trial | None = None  # the one running (its blocks' writers: handed off or not)
        self._held = 0  # decode steps since the last verdict
        self._last: tuple[bool, float, bool] | None = None  # (writer, clock, first of its block) at the last decode end
        self._seen = 0.0  # the clock at the last decode step's end
        self._start(0.0)

    @property
    def order(self) -> tuple[bool, ...]:
        return block_order(True, False, self.blocks)

    def step_ended(self, decode: bool) -> bool:
        """A step ended — a decode step (`decode`), or something else: a prefill, a batch of commands, which breaks
        the chain of intervals. Returns the writer of what it appended."""
        now = self.clock()
        last, self._last = self._last, None
        trial = self.trial
        if not decode:
            return trial.order[trial.block] if trial is not None and trial.steps else self.handed_off
        if trial is not None and now - self._seen > STALE_S:
            trial = self._start(now)  # (its intervals are too old to compare with new ones)
        self._seen = now
        if trial is None:
            self._held += 1
            if self._held < self.hold_steps:
                return self.handed_off
            trial = self._start(now)
        if last is not None and not last[2]:  # the interval since the last decode step is its writer's cadence
            trial.intervals.setdefault(last[0], []).append(now - last[1])
        if trial.steps == self.block_steps:
            trial.block, trial.steps = trial.block + 1, 0
            if trial.block == len(trial.order):
                self._conclude(trial)
                return self.handed_off
        trial.steps += 1
        writer = trial.order[trial.block]
        self._last = (writer, now, trial.steps == 1)
        return writer

    def _start(self, now: float) -> Trial:
        self.trial, self._held = Trial(now, self.order), 0
        return self.trial

    def _conclude(self, trial: Trial) -> None:
        self.trial, self._held = None, 0
        self.trials += 1
        verdict = faster(trial.intervals, False, True, MARGIN, MIN_INTERVALS)
        if verdict is None:
            return  # other work broke nearly every interval: nothing to compare, the last verdict holds
        handed_off, medians = verdict
        if handed_off != self.handed_off or self.trials == 1:  # (logged when the writer changes, and the first time)
            logger.info("a decode step every %.0f µs with the outboxes' thread writing, %.0f µs with the engine "
                        "thread: written by %s", medians[True] * 1e6, medians[False] * 1e6,
                        "the outboxes' thread" if handed_off else "the engine thread")
        self.handed_off = handed_off
