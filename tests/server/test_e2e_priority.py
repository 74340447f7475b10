"""`priority` through HTTP against a real `linserve serve`: with `scheduling_policy: priority` a saturated server
serves the most urgent request at once — preempting a less urgent running one, which resumes later — and then
the others by priority and arrival; under fcfs a priority other than 0 is a 400 naming the field."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers import ServerProcess, metric

pytestmark = pytest.mark.slow


def eventually(condition, what: str, within: float = 60.0) -> None:
    """Wait for an event of the server's; the bound only catches a hang (no outcome depends on speed)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


class Stream:
    """A streaming completion read on its own thread: `tokens` counts what arrived; `close()` disconnects
    (the server frees its slot), which is how a test ends a request that would otherwise never finish."""

    def __init__(self, base: str, prompt: str, priority: int) -> None:
        self.tokens, self.status, self._stop = 0, None, threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base, prompt, priority), daemon=True)
        self._thread.start()

    def _read(self, base: str, prompt: str, priority: int) -> None:
        body = {"prompt": prompt, "max_tokens": 1_000_000, "ignore_eos": True, "stream": True, "priority": priority}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.tokens += 1
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


def test_the_most_urgent_waiting_request_gets_the_next_slot(tiny_checkpoint, tmp_path):
    """Every step is an event of the server's (tokens arriving on a stream, the waiting gauge), never a
    sleep: which request holds the one free slot is read from which stream receives tokens."""
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--session-store", "none", "--num-slots", "2",
                           "--reserved-slots", "1", "--max-n", "1", env={"LINSERVE_SCHEDULING_POLICY": "priority"})
    streams: list[Stream] = []
    try:
        holder = Stream(server.base, "x", 0)  # holds one slot throughout
        streams.append(holder)
        eventually(lambda: holder.tokens > 0, "the holder runs")
        first = Stream(server.base, "first", 0)  # the other slot
        streams.append(first)
        eventually(lambda: first.tokens > 0, "'first' runs")
        lows = []
        for number, name in enumerate(("low-1", "low-2", "low-3"), 1):  # queued behind it, one after another
            lows.append(Stream(server.base, name, 5))
            streams.append(lows[-1])
            eventually(lambda n=number: metric(server.base, "linserve_requests_waiting") == n, f"{name} waits")
        preempted = metric(server.base, "linserve_preemptions_total")
        urgent = httpx.post(f"{server.base}/v1/completions", json={
            "prompt": "urgent", "max_tokens": 4, "ignore_eos": True, "priority": -5}, timeout=120)
        assert urgent.status_code == 200 and urgent.json()["usage"]["completion_tokens"] == 4, urgent.text
        # it preempted "first" (less urgent and running; the holder arrived earlier), which resumes once it is
        # done — before the queued low-priority ones
        assert metric(server.base, "linserve_preemptions_total") == preempted + 1
        resumed_at = first.tokens
        eventually(lambda: first.tokens > resumed_at + 8, "'first' decodes again")
        assert metric(server.base, "linserve_requests_waiting") == 3 and not any(low.tokens for low in lows)
        first.close()
        for index, low in enumerate(lows):  # then the low ones, in arrival order, each when the slot frees
            eventually(lambda s=low: s.tokens > 0, f"low-{index + 1} runs")
            assert not any(later.tokens for later in lows[index + 1:])
            eventually(lambda n=2 - index: metric(server.base, "linserve_requests_waiting") == n,
                       "the gauge counts the others")
            low.close()
        assert all(stream.status == 200 for stream in streams) and holder.tokens > 0
    finally:
        for stream in streams:
            stream._stop.set()
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
