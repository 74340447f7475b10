"""The engine core's outboxes (server/engine_process/core_main.py): a step's events are written by the engine thread
or, where that costs it much, by the outboxes' own thread — in order with every other flush either way — and a
frontend that does not read holds the engine once its backlog is full: nothing is lost, nothing grows unbounded."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from linserve.server.engine_process.core_main import BACKLOG_EVENTS, Outboxes, WriteHandoff


def received(conn, count: int) -> list:
    """The frontend's side: `count` events, batch by batch, in the order they came."""
    events = []
    while len(events) < count:
        kind, batch = conn.recv()
        assert kind == "batch"
        events += batch
    return events


def test_the_engine_thread_hands_its_writes_off_while_they_cost_it_much_and_probes_again():
    handoff = WriteHandoff()
    for _ in range(WriteHandoff.PROBE_STEPS - 1):
        handoff.timed(300e-6)  # (a 2-vCPU VM's step write at one stream)
    assert not handoff.handed_off  # (decided on a whole probe)
    handoff.timed(10e-6)
    assert handoff.handed_off
    for _ in range(WriteHandoff.REPROBE_STEPS - 1):
        handoff.posted()
    assert handoff.handed_off
    handoff.posted()
    assert not handoff.handed_off  # the engine thread writes and times a probe again
    for _ in range(WriteHandoff.PROBE_STEPS // 2 + 1):
        handoff.timed(16e-6)
    for _ in range(WriteHandoff.PROBE_STEPS // 2 - 1):
        handoff.timed(900e-6)
    assert not handoff.handed_off  # the median's side of HANDOFF_US, not the mean's


@pytest.mark.parametrize("handed_off", [False, True], ids=["engine-thread-writes", "outboxes-thread-writes"])
def test_step_and_call_events_arrive_once_each_in_the_order_they_were_appended(handed_off):
    frontend, core = Pipe()
    outboxes = Outboxes([core])
    outboxes.opened()
    outboxes.handoff.handed_off = handed_off
    outboxes.handoff.timed = lambda seconds: None  # (this mode throughout)
    outboxes.handoff.posted = lambda: None
    total = 3000

    def engine() -> None:  # a step's events, then its end (the engine thread); now and then a call's flush
        for i in range(total):
            outboxes._append(("x", i))
            if i % 7 == 0:
                outboxes.step_done()
            if i % 500 == 0:
                outboxes.flush()
        outboxes.step_done()

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        assert [event[1] for event in received(frontend, total)] == list(range(total))
    finally:
        thread.join()
        outboxes.close()
    assert not outboxes._thread.is_alive()
    assert not frontend.poll(0.2)  # nothing sent twice


def test_a_frontend_that_does_not_read_holds_the_engine_once_its_backlog_is_full():
    frontend, core = Pipe()
    outboxes = Outboxes([core])
    outboxes.opened()
    outboxes.handoff.handed_off = True  # (the engine thread writing would block at once, bound or not)
    total, most = 3 * BACKLOG_EVENTS, [0]

    def engine() -> None:
        for i in range(total):  # 1 KB each, each its own (pickle writes one object once): 12 MB, far past the buffer
            outboxes._append(("x", i, i.to_bytes(4, "little") * 256))
            outboxes.post()
            most[0] = max(most[0], len(outboxes.all[0].events))

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join(1.0)
    try:
        assert thread.is_alive()  # waiting for the frontend (without the bound it appends all 12k in ms)
        assert most[0] <= BACKLOG_EVENTS + 1
    finally:
        events = received(frontend, total)  # the frontend reads: the engine goes on and nothing is lost
        thread.join()
        outboxes.close()
    assert [event[1] for event in events] == list(range(total))
