"""`priority` through HTTP against a real `linserve serve`: with `scheduling_policy: priority` a saturated server
serves the most urgent request at once — preempting a less urgent running one, which resumes later — and then
the others by priority and arrival; under fcfs a priority other than 0 is a 400 naming the field."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow


def waiting(base: str) -> float:
    return float(re.search(r"^linserve_requests_waiting (\S+)$", httpx.get(f"{base}/metrics").text, re.M).group(1))


def test_the_most_urgent_waiting_request_gets_the_next_slot(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--session-store", "none", "--num-slots", "2",
                           "--reserved-slots", "1", "--max-n", "1", env={"LINSERVE_SCHEDULING_POLICY": "priority"})
    finished: list[str] = []
    try:
        holder = httpx.stream("POST", f"{server.base}/v1/completions", json={  # holds one slot throughout
            "prompt": "x", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True}, timeout=120)
        holder.__enter__()

        def ask(name: str, priority: int, max_tokens: int) -> None:
            response = httpx.post(f"{server.base}/v1/completions", json={
                "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}, timeout=120)
            assert response.status_code == 200, response.text
            finished.append(name)

        threads = [threading.Thread(target=ask, args=("first", 0, 2000))]  # the other slot, for a while
        threads[0].start()
        time.sleep(0.3)  # "first" is admitted (the queue is empty before the others arrive)
        assert waiting(server.base) == 0
        deadline = time.monotonic() + 30
        for number, name in enumerate(("low-1", "low-2", "low-3"), 1):  # queued behind it, one after another
            threads.append(threading.Thread(target=ask, args=(name, 5, 4)))
            threads[-1].start()
            while waiting(server.base) < number and time.monotonic() < deadline:
                time.sleep(0.01)
        assert waiting(server.base) == 3 and finished == []
        threads.append(threading.Thread(target=ask, args=("urgent", -5, 4)))
        threads[-1].start()
        while waiting(server.base) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        for thread in threads:
            thread.join(60)
        holder.__exit__(None, None, None)
        # the urgent request preempts "first" (less urgent, running; the holder arrived earlier), which resumes
        # once it is done — before the queued low-priority ones, which follow in arrival order
        assert finished == ["urgent", "first", "low-1", "low-2", "low-3"]
    finally:
        server.stop()


def test_priority_under_fcfs_is_a_400(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--session-store", "none")
    try:
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/responses", {"input": "x"})):
            response = httpx.post(f"{server.base}{path}", json={**body, "priority": 3})
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text
            assert httpx.post(f"{server.base}{path}", json={**body, "priority": 0}).status_code == 200
    finally:
        server.stop()
