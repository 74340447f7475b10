"""The engine's slots, as the scheduler asks for them (its allocator): a request's slots on admission (a session
its own, a stateless request one per row, with a prefix-cache hit loaded), back when it ends, and — under
priority scheduling — a running request parked off its slots (each row's fixed-size state and sampling row
copied to the host) and put back when it gets slots again. Runs on the engine thread."""

from __future__ import annotations

import time
from collections.abc import Callable

from .constraint import GrammarRuntime
from .live import LiveRequest
from .prefix_cache import PrefixCache, scope_seed
from .sampling import SlotSampling
from .scheduler import SchedSeq
from .sessions.registry import SessionRegistry


class EngineSlots:
    def __init__(self, live: dict[str, LiveRequest], registry: SessionRegistry, pool, sampling: SlotSampling,
                 prefix_cache: PrefixCache, grammars: Callable[[], GrammarRuntime], preemptible: bool) -> None:
        self.live, self.registry, self.pool, self.sampling = live, registry, pool, sampling
        self.prefix_cache, self._grammars, self.preemptible = prefix_cache, grammars, preemptible

    def acquire(self, seq: SchedSeq) -> list[int] | None:
        """Slots for seq, or None to wait; if this raises, nothing it took stays taken."""
        live = self.live[seq.seq_id]
        now = time.monotonic()
        if seq.parked:
            return self._unpark(live)
        if live.session is not None:
            slot = self.registry.tiers.bring_to_device(live.session)
            if slot is not None:
                live.assign_slots([slot], now, self.sampling, self._grammars() if live.constrained else None)
            return None if slot is None else [slot]
        slots = self._allocate(seq.rows)
        if slots is None:
            return None
        try:
            live.prefix_digest = scope_seed(live.request.owner)
            if live.request.params.prompt_logprobs is None:  # scoring needs the logits of every prompt token
                hit_len, live.prefix_digest, entry = self.prefix_cache.lookup(live.feed, live.prefix_digest)
                live.prefix_hit = entry is not None
                if entry is not None:
                    self.pool.load(slots[0], entry)
                    seq.prefilled = live.consumed = hit_len
            live.assign_slots(slots, now, self.sampling, self._grammars() if live.constrained else None)
        except BaseException:
            for taken in slots:
                self.pool.free(taken)
            live.rows.clear()
            raise
        return slots

    def preempt(self, seq: SchedSeq) -> bool:
        """Park a running stateless request (priority scheduling): each unfinished row's state and sampling row
        are copied off its slot, and the slots are freed. A session's request keeps its slot (its own state)."""
        live = self.live[seq.seq_id]
        if live.session is not None or not self.preemptible:
            return False
        for row in live.rows:
            if row.slot in seq.slots:
                row.parked = {"state": self.pool.export(row.slot),
                              "sampling": self.sampling.export(row.slot)}
                self.pool.free(row.slot)
                row.slot = -1
        return True

    def _unpark(self, live: LiveRequest) -> list[int] | None:
        """Slots for a preempted request's rows, their states and sampling rows put back (None: not yet)."""
        parked = [row for row in live.rows if row.parked is not None]
        slots = self._allocate(len(parked))
        if slots is None:
            return None
        for row, slot in zip(parked, slots):
            self.pool.load(slot, row.parked["state"])
            self.sampling.load(slot, row.parked["sampling"])
            row.slot, row.parked = slot, None
        return slots

    def release(self, seq: SchedSeq, slots: list[int]) -> None:
        live = self.live.get(seq.seq_id)
        for slot in slots:
            if live is None or live.session is None or slot != live.session.slot:
                self.pool.free(slot)

    def _allocate(self, count: int) -> list[int] | None:
        """`count` free slots (idle sessions offloaded to make room), or None and nothing taken."""
        slots: list[int] = []
        for _ in range(count):
            slot = self.registry.tiers.allocate_slot()
            if slot is None:
                for taken in slots:
                    self.pool.free(taken)
                return None
            slots.append(slot)
        return slots
