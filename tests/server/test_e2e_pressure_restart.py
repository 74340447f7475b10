"""Sessions taking turns under load through the split server's SIGTERM and a restart on the same store: every turn
a client was answered, and every turn whose answer was lost (retried with its Idempotency-Key), is in the session
exactly once — each session continues as a new session given the answered turns again does."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import ServerProcess, spawned_children

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0  # any one answer (a hang fails the test)


RESTART_SESSIONS = 6
TURN = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def turn_tokens(number: int) -> int:
    return 6 if number % 2 == 0 else 80  # (long turns: some are in flight when the drain begins)


def take_turns(base: str, sid: str, number: int, answered: list[dict], stop: threading.Event) -> int | None:
    """Greedy turns of one session, each with its own Idempotency-Key, until the server goes away; the turn whose
    outcome is unknown then (sent, no answer), or None."""
    turn = len(answered)
    while not stop.is_set():
        key = f"{sid}-turn-{turn}"
        try:
            response = httpx.post(f"{base}/v1/sessions/{sid}/completions", headers={"Idempotency-Key": key},
                                  json={"prompt": f" {number}.{turn}", **TURN, "max_tokens": turn_tokens(number)},
                                  timeout=TIMEOUT_S)
        except httpx.HTTPError:
            return turn  # (the server closed the connection: the turn may have been applied or not)
        if response.status_code != 200:  # draining (503), or gone: was it applied? the key will say
            return turn
        answered.append(response.json())
        turn += 1
    return None


def stop_under_load(server: ServerProcess, how: str) -> None:
    """SIGTERM to `serve` (every frontend drains, the core flushes the sessions: status 0), or SIGKILL to `serve`,
    its engine core and its frontends at once (nothing drains or flushes)."""
    if how == "sigterm":
        server.stop()
        assert server.process.returncode == 0, server.log.read_text()[-2000:]
        return
    for pid in [server.process.pid, *spawned_children(server.process.pid)]:
        os.kill(pid, signal.SIGKILL)
    server.process.wait(10)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_sessions_turning_under_load_through_a_stop_keep_every_answered_turn_exactly(tiny_checkpoint, tmp_path, how):
    """Six sessions take greedy turns at once, each with an Idempotency-Key, through the split server's SIGTERM —
    or SIGKILL to all its processes: a turn is answered only once it is stored; after a restart on the same store
    each unanswered turn is retried with its key (its first answer, if it was applied), and every session continues
    exactly as a new session given the answered turns again does."""
    args = ("--api-servers", "2", "--num-slots", "4", "--reserved-slots", "1")
    env = {"LINSERVE_SESSION_STORE": f"dir:{tmp_path / 'store'}"}
    first = ServerProcess(tiny_checkpoint, tmp_path / "a.log", *args, env=env)
    try:
        sids = [httpx.post(f"{first.base}/v1/sessions", json={"prompt": f"KING {n}."}).json()["id"]
                for n in range(RESTART_SESSIONS)]
        answered: list[list[dict]] = [[] for _ in sids]
        stop = threading.Event()
        with ThreadPoolExecutor(RESTART_SESSIONS) as pool:
            pending = [pool.submit(take_turns, first.base, sid, n, answered[n], stop) for n, sid in enumerate(sids)]
            time.sleep(3.0)
            stop_under_load(first, how)
            stop.set()
            unknown = [future.result() for future in pending]
    finally:
        first.stop()  # (a no-op once it has exited; a failure above leaves no server behind)
    assert all(answered) and sum(map(len, answered)) >= 12, [len(turns) for turns in answered]  # (under load)

    second = ServerProcess(tiny_checkpoint, tmp_path / "b.log", *args, env=env)
    try:
        for n, sid in enumerate(sids):
            if unknown[n] is not None:  # the same key again: applied once, whichever way the first try went
                retry = httpx.post(f"{second.base}/v1/sessions/{sid}/completions",
                                   json={"prompt": f" {n}.{unknown[n]}", **TURN, "max_tokens": turn_tokens(n)},
                                   headers={"Idempotency-Key": f"{sid}-turn-{unknown[n]}"}, timeout=TIMEOUT_S)
                assert retry.status_code == 200, retry.text
                answered[n].append(retry.json())
            # a new session given the same turns (each as long as its answer) answers each the same, and then
            # both continue alike
            replay = httpx.post(f"{second.base}/v1/sessions", json={"prompt": f"KING {n}."}).json()["id"]
            for turn, answer in enumerate(answered[n]):
                body = {"prompt": f" {n}.{turn}", **TURN, "max_tokens": answer["usage"]["completion_tokens"]}
                again = httpx.post(f"{second.base}/v1/sessions/{replay}/completions", json=body, timeout=TIMEOUT_S)
                assert again.json()["choices"][0]["text"] == answer["choices"][0]["text"], (n, turn, answer)
            body = {"prompt": " next", **TURN}
            original = httpx.post(f"{second.base}/v1/sessions/{sid}/completions", json=body, timeout=TIMEOUT_S)
            replayed = httpx.post(f"{second.base}/v1/sessions/{replay}/completions", json=body, timeout=TIMEOUT_S)
            assert original.status_code == 200, original.text
            assert original.json()["choices"][0]["text"] == replayed.json()["choices"][0]["text"], n
    finally:
        second.stop()
