"""Continuous-batching scheduler: waiting and running queues, admission by free state slots, a per-step
token budget. Torch-free: it decides, the engine executes, and slots come from an allocator.

Admission order: arrival (`fcfs`), or with `priority` the smallest `priority - waited // aging_s` first, ties by
arrival — a request waiting `aging_s` seconds counts one level more urgent, so a steady stream of urgent work
delays a patient request by at most (its priority - theirs) × aging_s, never forever. Admission never overtakes
the request it chose: if that one finds no slot, nothing behind it is admitted this step. Under `priority` it
may preempt running sequences less urgent than itself: their rows' fixed-size states move to the host (the
allocator parks them) and they wait, with their arrival time, to resume decoding where they stopped."""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class Status(enum.Enum):
    WAITING = "waiting"  # no slot yet
    PREFILLING = "prefilling"  # holds its slot(s), prompt partly consumed
    RUNNING = "running"  # decoding one token per row per step


@dataclass
class SchedSeq:
    seq_id: str
    to_prefill: int  # prompt tokens to consume before the first sample (0: sample from stored logits)
    rows: int = 1  # n parallel samples; prefilled once, then forked into `rows` slots
    prefilled: int = 0
    status: Status = Status.WAITING
    slots: list[int] = field(default_factory=list)
    priority: int = 0  # lower first (scheduling_policy "priority")
    arrival: float = field(default_factory=time.monotonic)
    parked: bool = False  # preempted while running: it resumes decoding when it gets slots again

    @property
    def prefill_left(self) -> int:
        return self.to_prefill - self.prefilled


class SlotAllocator(Protocol):
    def acquire(self, seq: SchedSeq) -> list[int] | None:
        """`seq.rows` slots for seq, or None if they cannot be had now (may offload idle sessions)."""

    def release(self, seq: SchedSeq, slots: list[int]) -> None:
        """Give slots back (a session keeps its own slot: the allocator knows which)."""

    def preempt(self, seq: SchedSeq) -> bool:
        """Park a running sequence's rows off their slots and free them (False: it cannot be preempted)."""


@dataclass(frozen=True)
class StepPlan:
    decode: list[tuple[str, int]]  # (seq_id, slot): one token each
    prefill: list[tuple[str, int, int]]  # (seq_id, start, length); length 0 = sample from stored logits
    failed: list[tuple[str, Exception]] = field(default_factory=list)  # admission raised: dropped from the queue

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def prefill_tokens(self) -> int:
        return sum(length for _, _, length in self.prefill)


class Scheduler:
    def __init__(self, allocator: SlotAllocator, max_batch_tokens: int, max_prefill_chunk: int,
                 max_prefill_while_decoding: int | None = None, policy: str = "fcfs",
                 aging_s: float = 5.0, prefill_call: Callable[[], tuple[int, int]] | None = None) -> None:
        """`prefill_call()`: (T, rows) of the compiled prefill program while its largest bucket is ready, else
        (0, 0) — a prompt that fits one call is then priced as its share of a call while streams decode."""
        if max_batch_tokens < 1 or max_prefill_chunk < 1:
            raise ValueError("max_batch_tokens and max_prefill_chunk must be >= 1")
        self.allocator = allocator
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_chunk = max_prefill_chunk
        # while streams are decoding, prefill at most this many tokens per step (bounds their ITL)
        self.max_prefill_while_decoding = max_prefill_while_decoding or max_batch_tokens
        if policy not in ("fcfs", "priority") or aging_s <= 0:
            raise ValueError("policy is 'fcfs' or 'priority', aging_s > 0")
        self.policy, self.aging_s = policy, aging_s
        self.prefill_call = prefill_call
        self.preemptions = 0  # running sequences parked for more urgent ones, so far
        self.waiting: OrderedDict[str, SchedSeq] = OrderedDict()
        self.active: OrderedDict[str, SchedSeq] = OrderedDict()  # prefilling or running, arrival order
        # the decode rows (seq_id, slot) as the last step had them, until a running row starts, ends or moves: the
        # same list object step after step (the engine keeps what it derives from it while it is the same)
        self._decode: list[tuple[str, int]] | None = None
        # (running, prefilling) sequences among the active, counted again only after one starts, ends or changes
        # status (read every step for the gauges: a pass over every active sequence each time was ~1 µs a row)
        self._counts: tuple[int, int] | None = None

    # ---- queue changes ----
    def add(self, seq: SchedSeq) -> None:
        if seq.seq_id in self.waiting or seq.seq_id in self.active:
            raise ValueError(f"duplicate sequence id {seq.seq_id}")
        self.waiting[seq.seq_id] = seq

    def remove(self, seq_id: str) -> SchedSeq | None:
        """Drop a sequence wherever it is (abort or finish) and release its slots."""
        seq = self.waiting.pop(seq_id, None) or self.active.pop(seq_id, None)
        self._counts = None
        if seq is not None and seq.status is Status.RUNNING:
            self._decode = None
        if seq is not None and seq.slots:
            self.allocator.release(seq, list(seq.slots))
            seq.slots = []
        return seq

    def finish_row(self, seq_id: str, slot: int) -> bool:
        """One row of a running sequence is done; returns True when the whole sequence is."""
        seq = self.active[seq_id]
        self._decode = None
        seq.slots.remove(slot)
        self.allocator.release(seq, [slot])
        if not seq.slots:
            del self.active[seq_id]
            self._counts = None
            return True
        return False

    def prefilled(self, seq_id: str, n_tokens: int) -> bool:
        """Record consumed prompt tokens; True once the prompt is complete (the sequence now runs)."""
        seq = self.active[seq_id]
        seq.prefilled += n_tokens
        if seq.prefill_left <= 0:
            seq.status = Status.RUNNING
            self._decode = self._counts = None
            return True
        return False

    # ---- the decision ----
    def schedule(self) -> StepPlan:
        """One decode token for every running row, then prefill in arrival order within the budget."""
        decode = self._decode
        if decode is None:
            decode = self._decode = [(s.seq_id, slot) for s in self.active.values() if s.status is Status.RUNNING
                                     for slot in s.slots]
        budget = self.max_batch_tokens - len(decode)
        call = (0, 0)  # while decoding: (T, a prompt's share of one prefill program call) — see _priced_chunk
        if decode:
            budget = min(budget, self.max_prefill_while_decoding)
            tokens, rows = self.prefill_call() if self.prefill_call is not None else (0, 0)
            call = (tokens, -(-tokens // rows)) if rows else (0, 0)
        prefill: list[tuple[str, int, int]] = []
        for seq in self.active.values() if self._status_counts()[1] else ():
            if seq.status is Status.PREFILLING and budget > 0:
                length, cost = self._priced_chunk(seq, budget, call)
                prefill.append((seq.seq_id, seq.prefilled, length))
                budget -= cost
        failed: list[tuple[str, Exception]] = []
        while self.waiting and budget > 0:
            seq = self._next_waiting()
            try:
                slots = self.allocator.acquire(seq)
                while slots is None and (victim := self._victim(seq)) is not None:
                    self._park(victim)
                    decode = [(seq_id, slot) for seq_id, slot in decode if seq_id != victim.seq_id]
                    slots = self.allocator.acquire(seq)
            except Exception as error:  # noqa: BLE001 - this sequence fails; the queue goes on
                del self.waiting[seq.seq_id]
                failed.append((seq.seq_id, error))
                continue
            if slots is None:
                break  # nothing overtakes the chosen request (see the module doc)
            del self.waiting[seq.seq_id]
            self.active[seq.seq_id] = seq
            self._counts = None
            if seq.parked:  # preempted while running: it decodes again from the next step
                seq.slots, seq.status, seq.parked = slots, Status.RUNNING, False
                self._decode = None
                budget -= len(slots)
                continue
            seq.slots, seq.status = slots, Status.PREFILLING
            length, cost = self._priced_chunk(seq, budget, call)
            prefill.append((seq.seq_id, seq.prefilled, length))
            budget -= max(cost, 1)
        return StepPlan(decode=decode, prefill=prefill, failed=failed)

    def _urgency(self, seq: SchedSeq, now: float) -> tuple[int, float]:
        return seq.priority - int((now - seq.arrival) // self.aging_s), seq.arrival

    def _victim(self, waiting: SchedSeq) -> SchedSeq | None:
        """Under `priority`, a running sequence less urgent than the waiting one, to preempt (the least urgent,
        the latest of equals); its rows' states go to the host, and it waits to resume where it was."""
        if self.policy != "priority":
            return None
        now = time.monotonic()
        level = self._urgency(waiting, now)[0]
        # both sides aged by the same clock: comparing the waiter's aged level with a running one's raw priority
        # let two equally patient requests preempt each other every step, forever (the level gap of any two
        # sequences only alternates between two adjacent values, so with both aged no pair can ever swap back)
        running = [s for s in self.active.values()
                   if s.status is Status.RUNNING and self._urgency(s, now)[0] > level]
        for victim in sorted(running, key=lambda s: (s.priority, s.arrival), reverse=True):
            if self.allocator.preempt(victim):
                return victim
        return None

    def _park(self, victim: SchedSeq) -> None:
        del self.active[victim.seq_id]
        self._decode = self._counts = None
        victim.slots, victim.status, victim.parked = [], Status.WAITING, True
        self.waiting[victim.seq_id] = victim
        self.preemptions += 1

    def _next_waiting(self) -> SchedSeq:
        if self.policy == "fcfs":
            return next(iter(self.waiting.values()))
        now = time.monotonic()
        return min(self.waiting.values(), key=lambda s: self._urgency(s, now))

    def _priced_chunk(self, seq: SchedSeq, budget: int, call: tuple[int, int]) -> tuple[int, int]:
        """(length, what it costs of the budget). `call` = (T, share): the rest of a prompt of at most T tokens, or
        T tokens of a longer one, runs as one row of one compiled prefill call, padded to T — the call costs the
        same for 1 or T tokens, and its rows share it — so it costs `share` (T / the call's rows) where that fits
        the budget; anything else costs its tokens. (A chunk of fewer tokens than the budget left would be a call
        of its own: two arrivals' first 16 tokens ride one 2-row call, not a 16-token call and an 8-token one.)"""
        tokens, share = call
        whole = min(seq.prefill_left, tokens)  # the rest of the prompt, or one call's T tokens of it
        if 0 < share <= budget and whole > 0 and self._chunk(seq, whole) == whole:  # (no boundary inside)
            return whole, share
        length = self._chunk(seq, budget)
        return length, length

    def _chunk(self, seq: SchedSeq, budget: int) -> int:
        """Next prefill length: chunk ends stay on multiples of max_prefill_chunk (prefix-cache boundaries)."""
        to_boundary = self.max_prefill_chunk - seq.prefilled % self.max_prefill_chunk
        return min(seq.prefill_left, to_boundary, budget)

    def _status_counts(self) -> tuple[int, int]:
        counts = self._counts
        if counts is None:
            statuses = [seq.status for seq in self.active.values()]
            counts = self._counts = (statuses.count(Status.RUNNING), statuses.count(Status.PREFILLING))
        return counts

    @property
    def num_running(self) -> int:
        return self._status_counts()[0]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self._status_counts()[1]
