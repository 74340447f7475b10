"""Scheduler decisions with a fake allocator: no torch, no model."""

from __future__ import annotations

import subprocess
import sys

from linserve.server.engine.scheduler import SchedSeq, Scheduler, Status


class FakeAllocator:
    """Slots 0..n-1; 'idle sessions' can be offloaded to make room, as the engine's allocator does."""

    def __init__(self, slots: int, idle_sessions: int = 0) -> None:
        self.free = list(range(slots))
        self.idle_on_device = [slots - 1 - i for i in range(idle_sessions)]
        for slot in self.idle_on_device:
            self.free.remove(slot)
        self.offloaded: list[int] = []
        self.released: list[int] = []

    def acquire(self, seq):
        while len(self.free) < seq.rows and self.idle_on_device:
            slot = self.idle_on_device.pop(0)
            self.offloaded.append(slot)
            self.free.append(slot)
        if len(self.free) < seq.rows:
            return None
        return [self.free.pop(0) for _ in range(seq.rows)]

    def release(self, seq, slots):
        self.released.extend(slots)
        self.free.extend(slots)

    def preempt(self, seq):
        self.free.extend(seq.slots)
        return True


def run_to_running(scheduler: Scheduler) -> None:
    plan = scheduler.schedule()
    for seq_id, _, length in plan.prefill:
        scheduler.prefilled(seq_id, length)


def test_engine_package_scheduler_is_torch_free():
    code = "import sys; import linserve.server.engine.scheduler; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_budget_is_respected_and_decode_comes_first():
    scheduler = Scheduler(FakeAllocator(8), max_batch_tokens=20, max_prefill_chunk=8)
    for i in range(3):
        scheduler.add(SchedSeq(f"r{i}", to_prefill=1))
    run_to_running(scheduler)
    scheduler.add(SchedSeq("long", to_prefill=100))
    plan = scheduler.schedule()
    assert len(plan.decode) == 3
    assert plan.prefill == [("long", 0, 8)]  # chunk size caps it
    assert len(plan.decode) + plan.prefill_tokens <= 20
    tight = Scheduler(FakeAllocator(8), max_batch_tokens=5, max_prefill_chunk=8)
    for i in range(3):
        tight.add(SchedSeq(f"r{i}", to_prefill=1))
    run_to_running(tight)
    tight.add(SchedSeq("long", to_prefill=100))
    plan = tight.schedule()
    assert len(plan.decode) == 3 and plan.prefill == [("long", 0, 2)]


def test_chunks_end_on_block_boundaries():
    scheduler = Scheduler(FakeAllocator(4), max_batch_tokens=100, max_prefill_chunk=16)
    seq = SchedSeq("p", to_prefill=50, prefilled=5)  # e.g. after a prefix-cache hit that was not aligned
    scheduler.add(seq)
    ends = []
    while seq.status is not Status.RUNNING:
        plan = scheduler.schedule()
        for seq_id, start, length in plan.prefill:
            ends.append(start + length)
            scheduler.prefilled(seq_id, length)
    assert ends == [16, 32, 48, 50]


def test_fifo_admission_when_slots_are_full():
    allocator = FakeAllocator(2)
    scheduler = Scheduler(allocator, max_batch_tokens=64, max_prefill_chunk=8)
    scheduler.add(SchedSeq("a", to_prefill=2))
    scheduler.add(SchedSeq("b", to_prefill=2, rows=2))  # needs two slots: blocks the queue head
    scheduler.add(SchedSeq("c", to_prefill=2))
    scheduler.schedule()
    assert list(scheduler.active) == ["a"]  # c would fit, but does not overtake b
    assert list(scheduler.waiting) == ["b", "c"]
    scheduler.prefilled("a", 2)
    assert scheduler.finish_row("a", scheduler.active["a"].slots[0])
    scheduler.schedule()
    assert list(scheduler.active) == ["b"] and list(scheduler.waiting) == ["c"]


def test_offload_makes_room_and_release_returns_slots():
    allocator = FakeAllocator(2, idle_sessions=2)
    scheduler = Scheduler(allocator, max_batch_tokens=64, max_prefill_chunk=8)
    scheduler.add(SchedSeq("new", to_prefill=3))
    scheduler.schedule()
    assert list(scheduler.active) == ["new"] and allocator.offloaded == [1]
    removed = scheduler.remove("new")
    assert removed.seq_id == "new" and allocator.released == [1]
    assert scheduler.num_waiting == 0 and scheduler.num_running == 0


def test_abort_while_waiting_releases_nothing():
    allocator = FakeAllocator(1)
    scheduler = Scheduler(allocator, max_batch_tokens=8, max_prefill_chunk=8)
    scheduler.add(SchedSeq("holder", to_prefill=1))
    scheduler.add(SchedSeq("queued", to_prefill=1))
    scheduler.schedule()
    assert scheduler.remove("queued").status is Status.WAITING
    assert allocator.released == []


def test_zero_length_prefill_samples_from_stored_logits():
    scheduler = Scheduler(FakeAllocator(1), max_batch_tokens=8, max_prefill_chunk=8)
    scheduler.add(SchedSeq("session", to_prefill=0))
    plan = scheduler.schedule()
    assert plan.prefill == [("session", 0, 0)]
    assert scheduler.prefilled("session", 0)


def test_prefill_is_throttled_while_streams_decode():
    scheduler = Scheduler(FakeAllocator(4), max_batch_tokens=300, max_prefill_chunk=256, max_prefill_while_decoding=24)
    scheduler.add(SchedSeq("idle-start", to_prefill=600))
    assert scheduler.schedule().prefill == [("idle-start", 0, 256)]  # nobody decoding: full chunks
    scheduler.prefilled("idle-start", 256)
    scheduler.add(SchedSeq("short", to_prefill=1))
    scheduler.schedule()
    scheduler.prefilled("short", 1)  # now "short" decodes
    plan = scheduler.schedule()
    assert plan.decode == [("short", scheduler.active["short"].slots[0])]
    assert plan.prefill_tokens == 24


def test_short_prompts_are_priced_as_their_share_of_one_prefill_program_call_while_streams_decode():
    """With the compiled prefill program ready (T 16, 2 rows a call), a whole prompt of at most T tokens — or T tokens
    of a longer one — costs T / 2 of the while-decoding budget: two 16-token arrivals join a decoding step, not one;
    with no program ready chunks cost their tokens as before."""
    ready = {"call": (16, 2)}
    scheduler = Scheduler(FakeAllocator(8), max_batch_tokens=300, max_prefill_chunk=256, max_prefill_while_decoding=16,
                          prefill_call=lambda: ready["call"])
    scheduler.add(SchedSeq("running", to_prefill=1))
    scheduler.schedule()
    scheduler.prefilled("running", 1)  # now it decodes
    for name, tokens in (("a", 16), ("b", 12), ("c", 16), ("long", 40)):
        scheduler.add(SchedSeq(name, to_prefill=tokens))
    plan = scheduler.schedule()
    assert plan.prefill == [("a", 0, 16), ("b", 0, 12)]  # one call's worth: two arrivals, whole
    for seq_id, _, length in plan.prefill:
        scheduler.prefilled(seq_id, length)
    plan = scheduler.schedule()
    # a longer prompt: one call's T tokens of it at the same share (an 8-token chunk would be a call of its own)
    assert plan.prefill == [("c", 0, 16), ("long", 0, 16)]
    scheduler.prefilled("c", 16)
    scheduler.prefilled("long", 16)
    ready["call"] = (0, 0)  # no program ready: tokens again
    scheduler.add(SchedSeq("d", to_prefill=10))
    scheduler.add(SchedSeq("e", to_prefill=10))
    assert scheduler.schedule().prefill == [("long", 16, 16)]
    scheduler.prefilled("long", 16)
    assert scheduler.schedule().prefill == [("long", 32, 8), ("d", 0, 8)]


def admitted(plan) -> list[str]:
    return [seq_id for seq_id, _, _ in plan.prefill]


def test_priority_admits_the_most_urgent_first_and_fcfs_keeps_arrival_order():
    for policy, expected in (("priority", ["urgent", "normal", "patient"]), ("fcfs", ["patient", "normal", "urgent"])):
        scheduler = Scheduler(FakeAllocator(1), max_batch_tokens=64, max_prefill_chunk=8, policy=policy)
        for name, priority in (("patient", 5), ("normal", 0), ("urgent", -3)):
            scheduler.add(SchedSeq(name, to_prefill=4, priority=priority))
        order = []
        for _ in range(3):  # one slot: one admission per finished request
            plan = scheduler.schedule()
            order += admitted(plan)
            scheduler.remove(admitted(plan)[0])
        assert order == expected


def test_waiting_ages_a_patient_request_past_newer_urgent_ones():
    scheduler = Scheduler(FakeAllocator(1), max_batch_tokens=64, max_prefill_chunk=8, policy="priority", aging_s=1.0)
    scheduler.add(SchedSeq("patient", to_prefill=4, priority=3, arrival=0.0))  # waited long: 3 levels aged away
    import time

    now = time.monotonic()
    scheduler.add(SchedSeq("urgent", to_prefill=4, priority=0, arrival=now))
    assert now > 4.0  # the patient one has waited more than (3 - 0) × aging_s
    assert admitted(scheduler.schedule()) == ["patient"]
    fresh = Scheduler(FakeAllocator(1), max_batch_tokens=64, max_prefill_chunk=8, policy="priority", aging_s=60.0)
    fresh.add(SchedSeq("patient", to_prefill=4, priority=3, arrival=now - 2))
    fresh.add(SchedSeq("urgent", to_prefill=4, priority=0, arrival=now))
    assert admitted(fresh.schedule()) == ["urgent"]


def test_nothing_overtakes_the_chosen_request_when_it_finds_no_slot():
    scheduler = Scheduler(FakeAllocator(2), max_batch_tokens=64, max_prefill_chunk=8, policy="priority")
    scheduler.add(SchedSeq("running", to_prefill=4, priority=-5))  # more urgent than anything waiting: kept
    run_to_running(scheduler)
    scheduler.add(SchedSeq("wide", to_prefill=4, rows=2, priority=-1))  # needs 2 slots, 1 is free
    scheduler.add(SchedSeq("narrow", to_prefill=4, priority=0))
    assert admitted(scheduler.schedule()) == []  # the chosen one waits; "narrow" does not jump it
    scheduler.remove("running")
    assert admitted(scheduler.schedule()) == ["wide"]


def test_a_more_urgent_request_preempts_the_least_urgent_running_one_which_resumes_without_prefill():
    allocator = FakeAllocator(2)
    scheduler = Scheduler(allocator, max_batch_tokens=64, max_prefill_chunk=8, policy="priority")
    scheduler.add(SchedSeq("normal", to_prefill=4, priority=0))
    scheduler.add(SchedSeq("patient", to_prefill=4, priority=5))
    run_to_running(scheduler)
    scheduler.add(SchedSeq("urgent", to_prefill=4, priority=-5))
    plan = scheduler.schedule()
    assert admitted(plan) == ["urgent"] and [seq_id for seq_id, _ in plan.decode] == ["normal"]  # patient parked
    assert scheduler.waiting["patient"].parked and scheduler.preemptions == 1
    scheduler.prefilled("urgent", 4)
    scheduler.add(SchedSeq("late", to_prefill=4, priority=9))  # less urgent than what runs: preempts nothing
    assert admitted(scheduler.schedule()) == [] and scheduler.preemptions == 1
    scheduler.remove("urgent")
    plan = scheduler.schedule()  # the parked one comes back first (priority 5 < 9), straight to decoding
    assert plan.prefill == [] and scheduler.active["patient"].status is Status.RUNNING
    assert sorted(seq_id for seq_id, _ in scheduler.schedule().decode) == ["normal", "patient"]
    fcfs = Scheduler(FakeAllocator(1), max_batch_tokens=64, max_prefill_chunk=8)
    fcfs.add(SchedSeq("first", to_prefill=4, priority=5))
    run_to_running(fcfs)
    fcfs.add(SchedSeq("urgent", to_prefill=4, priority=-5))
    assert admitted(fcfs.schedule()) == [] and fcfs.preemptions == 0  # fcfs never preempts


def test_equally_patient_requests_never_preempt_each_other():
    """Regression: a waiting request's *aged* level was compared with a running one's raw priority, so two
    priority-5 requests that had both waited past an aging step parked each other on every step, forever."""
    import time

    now = time.monotonic()
    scheduler = Scheduler(FakeAllocator(1), max_batch_tokens=64, max_prefill_chunk=8, policy="priority", aging_s=5.0)
    scheduler.add(SchedSeq("low-1", to_prefill=4, priority=5, arrival=now - 12))  # aged 2 levels: 3
    run_to_running(scheduler)
    scheduler.add(SchedSeq("low-2", to_prefill=4, priority=5, arrival=now - 11))  # aged 2 levels: 3
    for _ in range(5):
        plan = scheduler.schedule()
        assert admitted(plan) == [] and [seq_id for seq_id, _ in plan.decode] == ["low-1"]
    assert scheduler.preemptions == 0
    # an aged waiter still preempts what is less urgent than it after aging both: a fresh priority-4 runner
    aged = Scheduler(FakeAllocator(1), max_batch_tokens=64, max_prefill_chunk=8, policy="priority", aging_s=5.0)
    aged.add(SchedSeq("fresh", to_prefill=4, priority=4, arrival=now))
    run_to_running(aged)
    aged.add(SchedSeq("patient", to_prefill=4, priority=5, arrival=now - 12))  # level 3 < 4
    assert admitted(aged.schedule()) == ["patient"] and aged.preemptions == 1
    plan = aged.schedule()  # the parked one (level 4) does not take the slot back from the patient one (level 3)
    assert aged.preemptions == 1 and "fresh" in aged.waiting


def test_the_decode_list_is_the_same_object_until_a_running_row_starts_ends_or_moves():
    """The engine keeps the rows it derives from `plan.decode` while it is the same list: so every change to the
    running rows must give a new one, and one always equal to a fresh recount."""
    scheduler = Scheduler(FakeAllocator(4), max_batch_tokens=16, max_prefill_chunk=8, policy="priority")

    def recount():
        return [(s.seq_id, slot) for s in scheduler.active.values() if s.status is Status.RUNNING for slot in s.slots]

    scheduler.add(SchedSeq("a", to_prefill=1, rows=2, priority=5))
    scheduler.add(SchedSeq("b", to_prefill=1, priority=5))
    run_to_running(scheduler)
    first = scheduler.schedule().decode
    assert first == recount() and len(first) == 3
    assert scheduler.schedule().decode is first  # nothing changed
    scheduler.add(SchedSeq("waits", to_prefill=20, priority=5))  # a waiting or prefilling sequence: still the same
    plan = scheduler.schedule()
    assert plan.decode is first and plan.prefill == [("waits", 0, 8)]
    scheduler.prefilled("waits", 8)  # part of its prompt: not running yet
    assert scheduler.schedule().decode is first
    changes = [
        lambda: scheduler.prefilled("waits", 12),  # a prompt done: its row starts
        lambda: scheduler.finish_row("a", scheduler.active["a"].slots[0]),  # one of n rows ends
        lambda: scheduler.remove("b"),  # aborted while running
    ]
    for change in changes:
        before = scheduler.schedule().decode
        change()
        after = scheduler.schedule().decode
        assert after is not before and after == recount()
    before = scheduler.schedule().decode
    scheduler.add(SchedSeq("urgent", to_prefill=1, rows=3, priority=0))  # preempts "waits" (parks it)
    plan = scheduler.schedule()
    assert scheduler.preemptions == 1 and plan.decode == [("a", before[0][1])] == recount()
    assert scheduler.schedule().decode == recount()  # (the next step's list: the parked row is not in it)
    run_to_running(scheduler)  # "urgent" runs
    assert scheduler.schedule().decode == recount() and len(recount()) == 4
    scheduler.remove("urgent")
    plan = scheduler.schedule()  # "waits" resumes on slots again: decoding from the next step
    resumed = scheduler.schedule().decode
    assert resumed is not plan.decode and resumed == recount() and [seq for seq, _ in resumed] == ["a", "waits"]


def test_the_running_and_waiting_counts_are_a_recount_after_every_change():
    """The gauges' counts are kept between changes (not a pass over every active sequence each step): after any
    mix of arrivals, prefill chunks, admissions, preemptions, finished rows and aborts they equal a recount."""
    import random

    generator = random.Random(7)
    scheduler = Scheduler(FakeAllocator(6), max_batch_tokens=12, max_prefill_chunk=4, policy="priority")

    def check():
        statuses = [s.status for s in scheduler.active.values()]
        assert scheduler.num_running == statuses.count(Status.RUNNING)
        assert scheduler.num_waiting == len(scheduler.waiting) + statuses.count(Status.PREFILLING)

    seen = set()
    for step in range(400):
        roll = generator.random()
        if roll < 0.25:
            scheduler.add(SchedSeq(f"s{step}", to_prefill=generator.randint(0, 9), rows=generator.randint(1, 2),
                                   priority=generator.randint(0, 3)))
        elif roll < 0.75:
            plan = scheduler.schedule()
            check()
            for seq_id, _, length in plan.prefill:
                if generator.random() < 0.9:
                    scheduler.prefilled(seq_id, length)
        elif roll < 0.9 and scheduler.active:
            seq = generator.choice(list(scheduler.active.values()))
            if seq.status is Status.RUNNING:
                scheduler.finish_row(seq.seq_id, generator.choice(seq.slots))
        elif scheduler.waiting or scheduler.active:
            scheduler.remove(generator.choice([*scheduler.waiting, *scheduler.active]))
        check()
        seen.update(s.status for s in scheduler.active.values())
        seen.update("parked" for s in scheduler.waiting.values() if s.parked)
    assert seen == {Status.RUNNING, Status.PREFILLING, "parked"} and scheduler.preemptions > 0  # every path taken
