"""The store worker's health against a real directory store that disappears and comes back: a hysteresis (down
after consecutive failures, back after consecutive successes), one log line per change and a periodic summary
— not a line and a flip per failed write (issue 31 row 7)."""

from __future__ import annotations

import logging
import shutil
import time

import pytest

from linserve.server.engine.sessions import worker as worker_module
from linserve.server.engine.sessions.dir_store import DirStore
from linserve.server.engine.sessions.worker import StoreWorker

LOGGER = "linserve.server.engine.sessions.worker"


@pytest.fixture
def store_and_worker(tmp_path):
    path = tmp_path / "store"
    store = DirStore(path)
    worker = StoreWorker(store, timeout_s=2.0)
    yield path, store, worker
    worker.close()


def put(store, worker, n: int) -> bool:
    """One real write through the worker; whether it was stored (once the worker has judged its result)."""
    done = worker.submit("put", lambda deadline: store.put(f"sess-w{n}", b"record", owner="", deadline=deadline))
    stored = done.exception(10) is None
    assert worker.flush(10)
    return stored


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


def test_failures_between_successes_flip_nothing(store_and_worker, caplog):
    path, store, worker = store_and_worker
    flips = []
    worker.on_result = lambda op, result, seconds: flips.append(worker.up)
    caplog.set_level(logging.INFO, logger=LOGGER)
    for n in range(8):
        shutil.rmtree(path)
        assert not put(store, worker, 2 * n)
        path.mkdir()
        assert put(store, worker, 2 * n + 1)
    assert all(flips) and worker.up  # every failure was followed by a success: never down
    assert not lines(caplog, "is down") and not lines(caplog, "is back")
    assert worker.status() == {"kind": "dir", "up": True, "last_error": None}


def test_an_outage_is_one_line_down_one_line_back_and_summaries_between(store_and_worker, caplog):
    path, store, worker = store_and_worker
    worker.summary_interval_s = 0.3
    seen = []
    worker.on_result = lambda op, result, seconds: seen.append((op, result, worker.up))
    caplog.set_level(logging.INFO, logger=LOGGER)
    shutil.rmtree(path)
    assert not put(store, worker, 0)
    assert worker.up  # one failure is not an outage yet
    assert not put(store, worker, 1)
    assert not worker.up and worker.status()["last_error"] == "put: missing"
    started = time.monotonic()
    while time.monotonic() - started < 1.0:  # a burst of failing writes, and the idle probes between
        assert not put(store, worker, 2)
        time.sleep(0.05)
    down = lines(caplog, "is down")
    assert len(down) == 1 and "2 failed calls in a row" in down[0] and "missing" in down[0]
    summaries = lines(caplog, "still down")
    assert 1 <= len(summaries) <= 4, summaries  # one per 0.3 s, not one per failed write (about 20)
    path.mkdir()
    assert put(store, worker, 3)
    back_after_one = worker.up
    assert put(store, worker, 4)
    assert not back_after_one and worker.up, seen[-6:]  # back after two successes in a row
    back = lines(caplog, "is back")
    assert len(back) == 1 and "calls failed" in back[0], back
    assert len(lines(caplog, "is down")) == 1


def test_a_failure_makes_the_idle_worker_probe_within_a_second(store_and_worker):
    """After one failed call the idle thread probes at once (every second), so a store that is really gone is
    down within about a second with no more traffic — and one that is back comes back the same way."""
    path, store, worker = store_and_worker
    shutil.rmtree(path)
    assert not put(store, worker, 0)
    deadline = time.monotonic() + worker_module.PROBE_INTERVAL_DOWN_S * 3 + 1
    while worker.up:
        assert time.monotonic() < deadline, "no probe followed the failure"
        time.sleep(0.05)
    path.mkdir()
    deadline = time.monotonic() + worker_module.PROBE_INTERVAL_DOWN_S * (worker_module.RISE + 2) + 1
    while not worker.up:
        assert time.monotonic() < deadline, "the probes never brought the store back"
        time.sleep(0.05)


def test_the_worker_runs_its_torch_ops_on_one_thread(store_and_worker):
    """The worker's thread lives as long as the server: an OpenMP team of its own would make the engine's
    workers sleep between parallel regions (engine/cpu_threads.py: 48 -> 77 ms a step for fla's 340M shapes)."""
    import torch

    from linserve.server.engine.cpu_threads import _openmp_runtime

    if _openmp_runtime() is None:
        pytest.skip("no OpenMP runtime found in this process's mappings")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, _, worker = store_and_worker
        done = worker.submit("get", lambda deadline: torch.get_num_threads())
        assert done.result(10) == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
