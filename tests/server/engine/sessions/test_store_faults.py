"""Session-store faults against the real stores (a directory that disappears, a Redis that is frozen with
SIGSTOP or killed): nothing is acknowledged before it is stored, a failure leaves nothing behind (no
session, no slot), the engine thread never waits for the store (a stateless stream keeps its pace), and
after the store returns every acknowledged turn is there and every acknowledged delete is gone."""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time

import pytest

from linserve.server.engine import EngineError, EngineRequest, SamplingParams
from linserve.server.engine.types import FinishReason
from tests.helpers import Collector, assert_slots_balance, prompt, run, start_redis, tokens_of

GREEDY_6 = SamplingParams(max_tokens=6, temperature=0)
TIMEOUT_S = 2.0  # the store deadline in these tests (the paced stream's longest gap must stay well under it)
DURABLE_TIMEOUT_S = 5.0  # against a Redis that fsyncs every write


def assert_stored(outputs) -> None:
    """A session turn that ended as asked: its record was written before its end was sent."""
    assert outputs[-1].finish_reason is not FinishReason.ERROR, outputs[-1].error


def store_error(future) -> EngineError:
    with pytest.raises(EngineError) as error:
        future.result(10 * TIMEOUT_S + 10)
    assert error.value.kind in ("store_unavailable", "outcome_unknown"), error.value.message
    return error.value


def memory_sessions(engine) -> int:
    return engine.commands.call(lambda: len(engine.registry.by_id)).result(10)


def wait_up(engine, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not engine.store_worker.up:
        assert time.monotonic() < deadline, "the store never came back up"
        time.sleep(0.05)


class Pace:
    """A stateless stream running beside the session work; the gaps between its tokens, per phase."""

    def __init__(self, engine) -> None:
        self.engine, self.phase, self.gaps = engine, "baseline", {"baseline": [], "outage": [], "done": []}
        self.sink = Collector()
        params = SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True)
        engine.submit(EngineRequest("pace", prompt(4, 9), params), self.sink).result(10)
        self.sink.queue.get(timeout=10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            output = self.sink.queue.get(timeout=10)
            now = time.perf_counter()
            self.gaps[self.phase].append(now - last)
            last = now
            if output.finished:
                return

    def switch(self, phase: str, min_tokens: int = 200) -> None:
        """Start `phase` once the current one has at least `min_tokens` gaps."""
        deadline = time.monotonic() + 30
        while len(self.gaps[self.phase]) < min_tokens and time.monotonic() < deadline:
            time.sleep(0.01)
        self.phase = phase

    def stop(self) -> dict[str, float]:
        self.switch("done")
        self._stop.set()
        self.engine.abort("pace")
        self._thread.join(10)
        p99 = {phase: statistics.quantiles(self.gaps[phase], n=100)[98] for phase in ("baseline", "outage")}
        return {**p99, "max_outage": max(self.gaps["outage"]), "tokens": len(self.gaps["outage"])}


def assert_kept_pace(pace: dict[str, float]) -> None:
    """The engine never waited for the store: no gap of the stream beside the session work comes near the
    store's timeout (a stalled engine shows whole timeouts). How close the outage's p99 stays to the baseline's
    is a timing, measured by P13 (benchmarks/p13_store_outage.py), not asserted here: under a loaded CI
    machine a ratio of millisecond gaps failed while the engine never waited, and with a 0.5 s deadline a longest
    gap of 0.45 s was measured once in the suite (two workers on two CPUs; 5 ms alone, 20-26 ms beside a busy
    2-thread neighbour), with 1 s deadlines one of 0.77 s (2026-12-06): 2 s deadlines keep a stalled engine's whole
    timeouts far from such a hiccup."""
    assert pace["max_outage"] < 0.6 * TIMEOUT_S, pace


def session_work(engine, session_id: str, owner: str | None, tag: str) -> list[bool]:
    """A mix of session commands (create, continue, fork, delete); whether each succeeded."""
    done = []
    for future in [engine.sessions.create(owner) for _ in range(3)]:
        try:
            done.append(bool(future.result(10 * TIMEOUT_S + 10)))
        except EngineError as error:
            assert error.kind in ("store_unavailable", "outcome_unknown"), error.message
            done.append(False)
    try:
        outputs = run(engine, [7, 8], GREEDY_6, f"work-{tag}", session_id=session_id, owner=owner)
        done.append(outputs[-1].finish_reason is not FinishReason.ERROR)
    except EngineError as error:
        assert error.kind in ("store_unavailable", "outcome_unknown"), error.message
        done.append(False)
    for command in (lambda: engine.sessions.fork(session_id, owner), lambda: engine.sessions.delete(session_id, owner)):
        try:
            command().result(10 * TIMEOUT_S + 10)
            done.append(True)
        except EngineError as error:
            assert error.kind in ("store_unavailable", "outcome_unknown"), error.message
            done.append(False)
    return done


def test_a_missing_store_directory_fails_session_work_and_keeps_every_acknowledged_turn(make_engine, tmp_path):
    directory = tmp_path / "sessions"
    engine = make_engine(num_slots=8, session_store=f"dir:{directory}", session_store_timeout_s=TIMEOUT_S)
    kept = engine.sessions.create("k").result(10)
    run(engine, prompt(12, 1), GREEDY_6, "t1", session_id=kept.id, owner="k")  # acknowledged: on disk
    doomed = engine.sessions.create("k").result(10)
    reference = engine.sessions.fork(kept.id, "k").result(10)  # what `kept` continues with after the outage
    expected = tokens_of(run(engine, [5, 6], GREEDY_6, "ref", session_id=reference.id, owner="k"))
    pace = Pace(engine)
    scratch = engine.sessions.create("k").result(10)
    assert all(session_work(engine, scratch.id, "k", "up"))  # the same work with the store up: the baseline
    for session in engine.sessions.list("k", None, 100, True).result(10)[0]:
        if session.id not in (kept.id, doomed.id, reference.id):
            engine.sessions.delete(session.id, "k").result(10)
    before = memory_sessions(engine)
    pace.switch("outage")
    os.rename(directory, tmp_path / "elsewhere")  # the store's directory is gone (unmounted, removed)

    # the store is not known to be down yet: this turn is generated, then its write fails
    failed = run(engine, [7, 8], GREEDY_6, "t2", session_id=doomed.id, owner="k")
    assert failed[-1].finish_reason is FinishReason.ERROR and failed[-1].error_kind == "store_unavailable"
    assert not any(session_work(engine, kept.id, "k", "down"))  # now each change is refused at once
    store_error(engine.sessions.delete(doomed.id, "k"))
    assert memory_sessions(engine) == before - 1  # `doomed` rolled back to its record; nothing new is left
    assert not engine.store_worker.up
    assert_kept_pace(pace.stop())
    assert_slots_balance(engine)

    os.rename(tmp_path / "elsewhere", directory)
    wait_up(engine)
    assert engine.sessions.info(kept.id, "k").result(10).tokens == 12 + 6  # the acknowledged turn only
    assert tokens_of(run(engine, [5, 6], GREEDY_6, "t3", session_id=kept.id, owner="k")) == expected
    assert engine.sessions.info(doomed.id, "k").result(10).tokens == 0  # its failed turn is not part of it
    engine.sessions.delete(doomed.id, "k").result(10)
    engine.stop()
    restarted = make_engine(num_slots=8, session_store=f"dir:{directory}")
    with pytest.raises(EngineError) as error:
        restarted.sessions.info(doomed.id, "k").result(10)
    assert error.value.kind == "not_found"  # an acknowledged delete never comes back
    assert restarted.sessions.info(kept.id, "k").result(10).tokens == 12 + 6 + 2 + 6
    assert len(restarted.sessions.list("k", None, 100, True).result(10)[0]) == 2  # kept and reference
    assert_slots_balance(restarted)


def test_a_frozen_redis_fails_in_time_and_what_it_runs_on_waking_changes_nothing(make_engine, redis_url):
    url, server = redis_url
    engine = make_engine(num_slots=8, session_store=url, session_store_timeout_s=TIMEOUT_S)
    kept = engine.sessions.create("k").result(10)
    run(engine, prompt(10, 2), GREEDY_6, "t1", session_id=kept.id, owner="k")
    pace = Pace(engine)
    scratch = engine.sessions.create("k").result(10)
    assert all(session_work(engine, scratch.id, "k", "up"))
    for session in engine.sessions.list("k", None, 100, True).result(10)[0]:
        if session.id != kept.id:
            engine.sessions.delete(session.id, "k").result(10)
    store = engine.registry.store
    records = store.count()
    pace.switch("outage")
    turn = Collector()  # a turn under way when Redis freezes: generated, then its write times out
    long_turn = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    engine.submit(EngineRequest("t2", [7], long_turn, session_id=kept.id, owner="k"), turn).result(10)
    turn.queue.get(timeout=10)
    server.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        failed = turn.wait()
        # the write reached Redis and no answer came: it may have run (it did not: its deadline had passed when
        # Redis woke), and the turn's caller is told exactly that — 503 outcome_unknown, a retry with its key is safe
        assert failed[-1].finish_reason is FinishReason.ERROR and failed[-1].error_kind == "outcome_unknown"
        assert not any(session_work(engine, kept.id, "k", "down"))
        elapsed = time.monotonic() - started
        assert elapsed < 8 * (TIMEOUT_S + 0.5), elapsed  # each failed on its deadline, not on the store's return
        assert memory_sessions(engine) == 0  # the rolled-back turn dropped `kept`; no create left anything
        assert_kept_pace(pace.stop())
    finally:
        server.send_signal(signal.SIGCONT)
    wait_up(engine)
    time.sleep(0.3)  # Redis has run every command that was waiting in its socket
    assert store.count() == records  # none of the late writes landed
    info = engine.sessions.info(kept.id, "k").result(10)
    assert info.tokens == 10 + 6  # the acknowledged turn; the late turn and the late delete changed nothing
    assert_slots_balance(engine)


def test_a_dead_redis_leaves_nothing_behind_and_its_sessions_return_with_it(make_engine, tmp_path):
    url, server = start_redis(tmp_path, durable=True)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        # a dead Redis refuses at once: the deadline only has to outlast a write fsync'd by a loaded machine
        engine = make_engine(num_slots=8, session_store=url, session_store_timeout_s=DURABLE_TIMEOUT_S)
        kept = engine.sessions.create(None).result(10)
        assert_stored(run(engine, prompt(8, 3), GREEDY_6, "t1", session_id=kept.id))
        twin = engine.sessions.fork(kept.id, None).result(10)
        assert twin.tokens == 8 + 6
        reference = run(engine, [3], GREEDY_6, "ref", session_id=twin.id)
        assert_stored(reference)
        expected = tokens_of(reference)
        before = memory_sessions(engine)
        server.kill()  # SIGKILL: what it acknowledged is in its append-only file
        server.wait(10)
        for _ in range(10):
            store_error(engine.sessions.create(None))
        store_error(engine.sessions.rewind(kept.id, None, 1))
        assert memory_sessions(engine) == before  # nothing left behind (6 -> 21 sessions, before this fix)
        assert tokens_of(run(engine, prompt(4), GREEDY_6, "stateless"))  # stateless work goes on
        assert_slots_balance(engine)
        _, server = start_redis(tmp_path, port, durable=True)  # back, with its data
        wait_up(engine)
        assert tokens_of(run(engine, [3], GREEDY_6, "after", session_id=kept.id)) == expected
        assert engine.sessions.info(twin.id, None).result(10).tokens == 8 + 6 + 1 + 6
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_the_engine_thread_never_calls_the_store(make_engine, redis_url, tmp_path, kind):
    """Every store method, wrapped to note its caller's thread, over a session's whole life (create, turns,
    fork, export, import, rewind, listing, delete, a restart's load): never the engine thread."""
    spec = redis_url[0] if kind == "redis" else f"dir:{tmp_path / 'sessions'}"
    engine = make_engine(num_slots=8, session_store=spec)
    callers: set[str] = set()

    def watch(store) -> None:
        for name in ("put", "get", "delete", "expired", "count", "owned", "metadata", "unindex", "ping",
                     "revision", "acquire", "renew", "release"):
            method = getattr(store, name, None)
            if method is not None:
                def noted(*args, _method=method, **kwargs):
                    callers.add(threading.current_thread().name)
                    return _method(*args, **kwargs)
                setattr(store, name, noted)

    watch(engine.registry.store)
    session = engine.sessions.create("k").result(10)
    run(engine, prompt(9), GREEDY_6, "t1", session_id=session.id, owner="k")
    run(engine, [3], GREEDY_6, "t2", session_id=session.id, owner="k")
    fork = engine.sessions.fork(session.id, "k").result(10)
    imported = engine.sessions.import_(engine.sessions.export(session.id, "k").result(10), "k").result(10)
    engine.sessions.rewind(session.id, "k", 1).result(10)
    assert len(engine.sessions.list("k", None, 10, True).result(10)[0]) == 3
    engine.sessions.delete(fork.id, "k").result(10)
    engine.stop()
    second = make_engine(num_slots=8, session_store=spec)
    watch(second.registry.store)
    assert second.sessions.info(imported.id, "k").result(10).tokens == 9 + 6 + 1 + 6
    second.sessions.delete(imported.id, "k").result(10)
    assert callers == {"linserve-session-store"}, callers


def test_a_session_whose_first_turn_never_got_stored_deletes_cleanly_and_frees_its_lease(make_engine, redis_url):
    """What a failed create-with-prompt cleans up on a shared store: a session only in memory, claimed with a
    lease; deleting it drops it without touching the store and gives the lease back."""
    engine = make_engine(num_slots=8, session_store=redis_url[0])
    info = engine.sessions.create("k", first_prompt=True).result(10)
    assert engine.sessions.delete(info.id, "k").result(10) is None
    engine.store_worker.flush()
    assert engine.registry.store.acquire(info.id, "another-replica", 1000)  # no lease left behind
    with pytest.raises(EngineError) as error:
        engine.sessions.info(info.id, "k").result(10)
    assert error.value.kind == "not_found"


def test_a_create_abandoned_while_redis_is_frozen_leaves_nothing_once_it_wakes(make_engine, redis_url):
    """A create-with-prompt whose turn was stored, then failed before its answer (the client left): its session is
    abandoned while Redis is frozen. The create's own answer reads this process's copy (no store call an outage
    can fail); the delete cannot reach the store, so the copy goes at once and the record once Redis answers."""
    url, server = redis_url
    engine = make_engine(num_slots=8, session_store=url, session_store_timeout_s=TIMEOUT_S)
    store = engine.registry.store
    made = engine.sessions.create("k", first_prompt=True).result(10)
    run(engine, prompt(7, 4), SamplingParams(max_tokens=0), "first", session_id=made.id, owner="k")
    assert store.get(made.id) is not None  # the first turn stored the session
    before = memory_sessions(engine)
    server.send_signal(signal.SIGSTOP)
    try:
        assert engine.sessions.info(made.id, "k", here=True).result(10).tokens == 7  # no store call
        store_error(engine.sessions.info(made.id, "k"))  # (a lookup waits for the store, and fails)
        store_error(engine.sessions.abandon(made.id, "k", wait_s=1))
        deadline = time.monotonic() + 10
        while memory_sessions(engine) != before - 1:
            assert time.monotonic() < deadline, "the abandoned session stayed in memory"
            time.sleep(0.05)
        assert_slots_balance(engine)
    finally:
        server.send_signal(signal.SIGCONT)
    wait_up(engine)
    deadline = time.monotonic() + 15
    while store.get(made.id) is not None:  # removed after the first successful probe
        assert time.monotonic() < deadline, "the abandoned session's record stayed in the store"
        time.sleep(0.1)
    with pytest.raises(EngineError) as error:
        engine.sessions.info(made.id, "k").result(10)
    assert error.value.kind == "not_found"
    assert engine.sessions.list("k", None, 100, True).result(10)[0] == []
    assert_slots_balance(engine)
