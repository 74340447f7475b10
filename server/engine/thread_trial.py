"""Which thread count a compiled CPU step runs faster on *here*, served: chosen by timing the engine's own steps.

A compiled program's linserve kernels (the projections, the scans) split over the count in force when it runs
(cpu_threads.py, `kernel_threads`). Whether a second thread pays depends on the host and the step's rows, and the
measurements disagree across hosts: on 2 cores of a Zen 5, one thread served one stream 1.24× faster than two (the
second thread's spinning between small regions holds the CPU the frontend and the load generator need), while on
an AVX512 Xeon two served 8 streams 1.18× faster than one and an fp32 Xeon 1.05–1.13× at every load
(docs/benchmarks.md, "A compiled program's own thread count"). A fixed threshold of rows is a guess from a few
hosts; the engine can measure instead. The exact path computes the same bits on any count
(tests/model/families/test_thread_count.py), so trying both changes no output.

What is timed is the step's *cadence*: from one step's start to the next step's of the same program and bucket,
nothing else in between (no prefill, no other program, no row started or ended). That interval holds the program,
the engine's Python around it and the channel's write — and every preemption the second thread's spinning causes
the processes it shares the CPUs with, which a timing of the program alone would miss only in part.

For each (program, bucket, the two counts) in use, a trial runs `BLOCKS` blocks of `BLOCK_STEPS` steps on each
count, in the order other, default, default, other, … (`block_order`: a host whose speed drifts slows both alike),
drops each block's first interval (the count just changed: the workers wake), and compares the two medians. The
other count wins only when it is faster by more than `MARGIN`; the default — `kernel_threads` from
`KERNEL_THREADS_FROM_ROWS` rows, `threads` below — keeps ties, and keeps the bucket when other work broke the chain
so often that either count has fewer than `MIN_INTERVALS`. The choice then holds for `HOLD_S` (at least
`HOLD_FACTOR` times the trial's own length: a trial of slow steps is rarer) and is tried again, since the host's
other work comes and goes; each trial in a row that picks the same count doubles the hold, up to `MAX_HOLD_S` (half
of a trial runs on the slower count: a one-stream request arriving after a pause spent a quarter of its 512 steps
there, every time, while the verdict never changed), and a verdict that changes starts it at `HOLD_S` again. A trial
whose key falls out of use for longer than `STALE_S` starts over. Called on the engine thread only.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("linserve.engine")

BLOCK_STEPS = 32  # steps a block runs on one count
BLOCKS = 4  # blocks each count runs in a trial
MARGIN = 0.03  # the other count must be this much faster (its median cadence) to be chosen
HOLD_S = 30.0  # a choice holds this long before the next trial ...
HOLD_FACTOR = 20.0  # ... and at least this many times the trial's own length
MAX_HOLD_S = 600.0  # the longest hold that verdicts repeating double it to
STALE_S = 10.0  # a trial that saw no step of its key for this long starts over
MIN_INTERVALS = 8  # a verdict needs this many intervals of each count (else the default holds)


def block_order(other: int, default: int, blocks: int) -> tuple[int, ...]:
    """The counts' blocks in a trial: other, default, default, other, other, default, … — each count's blocks sit as
    late as the other's on average, so a drift in the host's speed through the trial (a request's first hundred
    milliseconds after a pause run slower) falls on both alike; plain alternation gave the default every later
    place."""
    return tuple(count for pair in range(blocks)
                 for count in ((other, default) if pair % 2 == 0 else (default, other)))


def faster(intervals: dict, default, other, margin: float = MARGIN,
           least: int = MIN_INTERVALS) -> tuple[object, dict] | None:
    """The trial's winner — `other` only where its median cadence is faster than `default`'s by more than `margin` —
    and both medians; None where either has fewer than `least` intervals (other work broke the chain: nothing to
    compare). Shared by the thread counts' trials and the core's writer trial (engine_process/write_handoff.py)."""
    if min(len(intervals.get(choice, ())) for choice in (default, other)) < least:
        return None
    medians = {choice: statistics.median(intervals[choice]) for choice in (default, other)}
    return (other if medians[other] < (1 - margin) * medians[default] else default), medians


@dataclass
class Trial:
    """One key's alternation: the counts' intervals so far and the block now running."""

    started: float
    order: tuple[int, ...]  # the count of each block (block_order)
    block: int = 0  # index into `order`
    steps: int = 0  # steps decided in this block
    intervals: dict[int, list[float]] = field(default_factory=dict)  # count → its steps' cadences (s)


@dataclass
class Choice:
    key: tuple  # the step's (program, bucket)
    count: int  # in force until `until`
    until: float
    trial: Trial | None = None
    seen: float = 0.0  # the clock at the key's last step
    repeats: int = 0  # trials in a row that picked `count` (its hold doubles with each after the first)


class ThreadTrials:
    """The engine thread's choice between two counts for each compiled step's key, by its measured cadence."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, block_steps: int = BLOCK_STEPS,
                 blocks: int = BLOCKS, margin: float = MARGIN, hold_s: float = HOLD_S) -> None:
        self.clock, self.block_steps, self.blocks, self.margin, self.hold_s = clock, block_steps, blocks, margin, hold_s
        self.choices: dict[tuple, Choice] = {}  # (key, default, other) → its choice
        self._last: tuple[tuple, int, bool, float] | None = None  # (key, count, timed, started) of the last step

    def interrupt(self) -> None:
        """Work other than this key's steps ran (a prefill, a changed set of rows): the next interval is not one."""
        self._last = None

    def count(self, key: tuple, default: int, other: int) -> int:
        """The count for a step of `key` starting now, `default` and `other` the two candidates (equal: no trial);
        the interval since the last step is that step's cadence when it had the same key."""
        now = self.clock()
        last, self._last = self._last, None
        if default == other:
            return default
        full = (key, default, other)
        choice = self.choices.get(full)
        if choice is None:
            choice = self.choices[full] = Choice(key, default, until=now)
        if last is not None and last[0] == full and last[2] and choice.trial is not None:
            choice.trial.intervals.setdefault(last[1], []).append(now - last[3])
        count, timed = self._decide(choice, now, default, other)
        choice.seen = now
        self._last = (full, count, timed, now)
        return count

    def describe(self) -> dict[str, int]:
        """The count in force for each program's bucket tried so far ("decode/8" → count). Asked from other threads
        too: the choices are copied in one step (a C-level copy the engine thread cannot interleave with)."""
        return {"/".join(map(str, choice.key)): choice.count for choice in list(self.choices.values())}

    def _decide(self, choice: Choice, now: float, default: int, other: int) -> tuple[int, bool]:
        trial = choice.trial
        if trial is not None and now - choice.seen > STALE_S:
            trial = choice.trial = None  # (its samples are too old to compare with new ones)
        if trial is None:
            if now < choice.until:
                return choice.count, False
            trial = choice.trial = Trial(now, block_order(other, default, self.blocks))
        if trial.steps == self.block_steps:
            trial.block, trial.steps = trial.block + 1, 0
            if trial.block == len(trial.order):
                self._conclude(choice, trial, now, default, other)
                return choice.count, False
        trial.steps += 1
        return trial.order[trial.block], trial.steps > 1  # (a block's first interval: the count just changed)

    def _conclude(self, choice: Choice, trial: Trial, now: float, default: int, other: int) -> None:
        choice.trial = None
        verdict = faster(trial.intervals, default, other, self.margin)
        if verdict is None:  # other work broke nearly every interval: the rule by rows, the shortest hold
            choice.count, choice.repeats = default, 0
            choice.until = now + self._hold(choice, trial, now)
            return
        chosen, medians = verdict
        passed = other if chosen == default else default
        choice.repeats = choice.repeats + 1 if chosen == choice.count and choice.repeats else 1
        choice.until = now + self._hold(choice, trial, now)
        if chosen != choice.count:
            logger.info("compiled steps %s: %d threads (%.3f ms a step) over %d (%.3f ms), timed served; tried "
                        "again in %.0f s", "/".join(map(str, choice.key)), chosen, 1e3 * medians[chosen], passed,
                        1e3 * medians[passed], choice.until - now)
        choice.count = chosen

    def _hold(self, choice: Choice, trial: Trial, now: float) -> float:
        """How long a verdict holds: `hold_s`, at least HOLD_FACTOR times the trial's length, doubled for each repeat
        of the same verdict after the first (up to MAX_HOLD_S)."""
        repeated = self.hold_s * 2 ** (choice.repeats - 1) if choice.repeats else 0.0
        return max(self.hold_s, HOLD_FACTOR * (now - trial.started), min(MAX_HOLD_S, repeated))
