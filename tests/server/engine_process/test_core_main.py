"""The engine core's outboxes (server/engine_process/core_main.py): a step's events are written by the engine thread
or, where the engine's steps go faster so, by the outboxes' own thread — in order with every other flush either way —
and a frontend that does not read holds the engine once its backlog is full: nothing is lost, nothing grows
unbounded."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from linserve.server.engine.types import PoolStats, StepStats
from linserve.server.engine_process.core_main import BACKLOG_EVENTS, Outboxes


def received(conn, count: int) -> list:
    """The frontend's side: `count` events, batch by batch, in the order they came."""
    events = []
    while len(events) < count:
        kind, batch = conn.recv()
        assert kind == "batch"
        events += batch
    return events


@pytest.mark.parametrize("handed_off", [False, True], ids=["engine-thread-writes", "outboxes-thread-writes"])
def test_step_and_call_events_arrive_once_each_in_the_order_they_were_appended(handed_off):
    frontend, core = Pipe()
    outboxes = Outboxes([core])
    outboxes.opened()
    outboxes.handoff.step_ended = lambda decoded: handed_off  # (this writer throughout)
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
    outboxes.handoff.step_ended = lambda decoded: True  # (the engine thread writing would block at once, bound or not)
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


def test_the_handoff_is_told_a_decode_steps_end_and_anything_else_as_other_work():
    frontend, core = Pipe()
    outboxes = Outboxes([core])
    outboxes.opened()
    told = []
    outboxes.handoff.step_ended = lambda decoded: told.append(decoded) or False
    pool = PoolStats(running=1, waiting=0, slots_in_use=1, slots_total=4, state_bytes_in_use=64, sessions_device=0,
                     sessions_host=0)
    try:
        for phase in ("decode", None, "prefill", "mixed", "decode", "decode"):  # (None: a batch of commands)
            if phase is not None:
                outboxes.stats(StepStats(duration_s=1e-3, phase=phase, batch_size=1, decode_tokens=1,
                                         prefill_tokens=0))
            outboxes.stats(pool)  # (unchanged after the first: not sent again, but a step's end all the same)
        assert told == [True, False, False, False, True, True]
        assert [kind for kind, *_ in received(frontend, 6)] == ["t", "p", "t", "t", "t", "t"]
    finally:
        outboxes.close()
