"""Issue 31 rows 2 and 3, through HTTP against a real redis-server: a store write whose answer is lost (a relay
drops Redis' reply to the one command) is a 503 `outcome_unknown`, and an `Idempotency-Key` makes the retry
safe — the turn that landed is never applied twice and its first answer comes back; a turn that did not land
is applied by the retry. `If-Match` refuses a continue whose session has moved (409 naming the revision)."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

from linserve.server.engine.sessions.redis_store import _DELETE, _PUT
from tests.helpers import ReplyDroppingProxy, ServerProcess, free_port, start_redis
from tests.server.test_e2e_store_faults import wait_store

pytestmark = pytest.mark.slow

PUT_SHA = hashlib.sha1(_PUT.encode()).hexdigest().encode()
DELETE_SHA = hashlib.sha1(_DELETE.encode()).hexdigest().encode()
TURN = {"prompt": " and", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def replica(tiny_checkpoint, tmp_path_factory):
    """One server for the module (each test works on its own sessions and keys)."""
    tmp_path = tmp_path_factory.mktemp("idempotency")
    port = free_port()
    url, redis = start_redis(tmp_path, port=port)
    proxy = ReplyDroppingProxy(port)
    env = {"LINSERVE_SESSION_STORE": f"redis://127.0.0.1:{proxy.port}/0", "LINSERVE_SESSION_STORE_TIMEOUT_S": "0.5"}
    server = ServerProcess(tiny_checkpoint, tmp_path / "a.log", env=env)
    yield server.base, proxy
    server.stop()
    proxy.close()
    redis.kill()
    redis.wait(10)


def tokens(base: str, sid: str) -> int:
    return httpx.get(f"{base}/v1/sessions/{sid}").json()["tokens"]


def continue_(base: str, sid: str, key: str | None = None, body: dict = TURN, **headers) -> httpx.Response:
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{base}/v1/sessions/{sid}/completions", json=body, headers=headers, timeout=60)


def unknown(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "outcome_unknown" and response.headers["retry-after"]


def test_a_turn_whose_write_answer_was_lost_is_retried_once_and_answered_as_first(replica):
    base, proxy = replica
    sid = httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}).json()["id"]
    before = tokens(base, sid)
    proxy.arm(PUT_SHA)  # the turn's record lands in Redis; its answer does not come back
    unknown(continue_(base, sid, "turn-1"))
    assert proxy.dropped == 1
    wait_store(base, up=True)
    retried = continue_(base, sid, "turn-1")
    assert retried.status_code == 200 and retried.headers["idempotent-replayed"] == "true", retried.text
    after = tokens(base, sid)
    assert after == before + 1 + 12  # applied once: the prompt and 12 tokens, not twice
    first = retried.json()
    assert retried.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 12, "total_tokens": 13}
    again = continue_(base, sid, "turn-1")  # any number of retries: the same answer, nothing applied
    assert again.json() == first and tokens(base, sid) == after
    streamed = continue_(base, sid, "turn-1", {**TURN, "stream": True})  # another body: another request
    assert streamed.status_code == 422 and streamed.json()["error"]["code"] == "idempotency_key_reused"
    # the answer is the turn the session holds: a fork continued from before it would generate the same text
    fresh = continue_(base, sid, "turn-2")
    assert fresh.status_code == 200 and "idempotent-replayed" not in fresh.headers
    assert tokens(base, sid) == after + 1 + 12


def test_a_turn_that_did_not_land_is_applied_by_its_retry(replica):
    """A turn's write held back in Redis past its deadline (CLIENT PAUSE WRITE) is answered outcome_unknown at
    the end of the stream; it did not land (its script saw the deadline had passed), so the retry with the key
    applies it (not a replay), once."""
    import redis as redis_client

    base, proxy = replica
    sid = httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}).json()["id"]
    before = tokens(base, sid)
    # long enough that the pause surely comes before the turn's write (12 tokens once ended and wrote before a loaded
    # suite's client had read the first line), short enough to end well inside the pause
    body = {**TURN, "max_tokens": 150, "stream": True}
    with httpx.stream("POST", f"{base}/v1/sessions/{sid}/completions", json=body,
                      headers={"Idempotency-Key": "late-1"}, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # generating: the lease is taken
        redis_client.Redis(port=proxy.redis_port).client_pause(3000, all=False)  # writes wait 3 s in Redis
        paused = time.monotonic()
        events = [line for line in lines if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["code"] == "outcome_unknown" and events[-1] == "data: [DONE]"
    time.sleep(max(0.0, paused + 3.1 - time.monotonic()))  # the pause is over: Redis ran the late write (no-op)
    wait_store(base, up=True)
    assert tokens(base, sid) == before  # it did not land
    with httpx.stream("POST", f"{base}/v1/sessions/{sid}/completions", json=body,
                      headers={"Idempotency-Key": "late-1"}, timeout=60) as retried:
        assert retried.status_code == 200 and "idempotent-replayed" not in retried.headers
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in retried.iter_lines()
                       if line.startswith("data: {"))
    assert tokens(base, sid) == before + 151
    replay = httpx.post(f"{base}/v1/sessions/{sid}/completions", json=body, headers={"Idempotency-Key": "late-1"})
    assert replay.headers["idempotent-replayed"] == "true"  # now it has landed: a further retry is a replay
    replayed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in replay.text.splitlines()
                       if line.startswith("data: {"))
    assert replayed == text and tokens(base, sid) == before + 151


def test_if_match_refuses_a_continue_on_a_moved_session(replica):
    base, _ = replica
    sid = httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}).json()["id"]
    revision = httpx.get(f"{base}/v1/sessions/{sid}").json()["revision"]
    assert revision
    assert continue_(base, sid, **{"If-Match": f'"{revision}"'}).status_code == 200
    current = httpx.get(f"{base}/v1/sessions/{sid}").json()["revision"]
    assert current != revision
    moved = continue_(base, sid, **{"If-Match": f'"{revision}"'})
    assert moved.status_code == 409, moved.text
    error = moved.json()["error"]
    assert error["code"] == "revision_mismatch" and current in error["message"] and error["param"] == "If-Match"
    assert continue_(base, sid, **{"If-Match": current}).status_code == 200


def test_creates_and_deletes_with_lost_answers_leave_exactly_what_was_asked(replica):
    """Row 3: a create whose record landed unanswered leaves nothing (the server removes it: its client was
    told it failed); a keyed create's retry makes one session; a keyed delete's retry answers 204."""
    base, proxy = replica

    def listed() -> set[str]:
        return {s["id"] for s in httpx.get(f"{base}/v1/sessions", params={"limit": 100}).json()["data"]}

    before = listed()  # the other tests' sessions
    __import__("redis").Redis(port=proxy.redis_port).script_load(_PUT)  # EVALSHA finds it: the write runs
    proxy.arm(PUT_SHA)  # an empty create: one write, the session's record, and its answer is lost
    unknown(httpx.post(f"{base}/v1/sessions", json={}))
    wait_store(base, up=True)
    deadline = time.monotonic() + 5
    while listed() != before:  # undone as soon as the store answers
        assert time.monotonic() < deadline, "the unanswered create's record stayed"
        time.sleep(0.1)
    proxy.arm(PUT_SHA)  # a create with a prompt: its first turn writes the record, and the answer is lost
    unknown(httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}, headers={"Idempotency-Key": "make-1"}))
    wait_store(base, up=True)
    made = httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}, headers={"Idempotency-Key": "make-1"})
    assert made.status_code == 200, made.text
    again = httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}, headers={"Idempotency-Key": "make-1"})
    assert again.json()["id"] == made.json()["id"] and again.headers["idempotent-replayed"] == "true"
    assert listed() == before | {made.json()["id"]}  # the failed attempt left nothing; the retry made one
    sid = made.json()["id"]
    __import__("redis").Redis(port=proxy.redis_port).script_load(_DELETE)  # EVALSHA finds it: the delete runs
    proxy.arm(DELETE_SHA)  # the delete runs in Redis; its answer is lost
    unknown(httpx.delete(f"{base}/v1/sessions/{sid}", headers={"Idempotency-Key": "drop-1"}))
    wait_store(base, up=True)
    gone = httpx.delete(f"{base}/v1/sessions/{sid}", headers={"Idempotency-Key": "drop-1"})
    assert gone.status_code == 204 and gone.headers["idempotent-replayed"] == "true"
    assert httpx.get(f"{base}/v1/sessions/{sid}").status_code == 404
    assert httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 404  # without the key: plainly gone
    assert listed() == before


def test_a_create_whose_first_turn_landed_unanswered_is_removed_even_when_its_cleanup_is_lost(replica):
    """A session created with a prompt whose first turn's record landed but whose answer was lost (a frozen or
    partitioned Redis), and whose first cleanup delete is lost too: the record is removed as soon as the store
    answers — nothing its client was told failed stays listed (P13 found this under load)."""
    base, proxy = replica

    def listed() -> set[str]:
        return {s["id"] for s in httpx.get(f"{base}/v1/sessions", params={"limit": 100}).json()["data"]}

    before = listed()
    client = __import__("redis").Redis(port=proxy.redis_port)
    client.script_load(_PUT)
    client.script_load(_DELETE)
    proxy.arm(PUT_SHA)  # the first turn's record lands; its answer is lost
    proxy.swallow(DELETE_SHA)  # and the first delete that follows never reaches Redis
    unknown(httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET."}, timeout=60))
    wait_store(base, up=True)
    deadline = time.monotonic() + 15
    while listed() != before:
        assert time.monotonic() < deadline, "the unanswered create's record stayed"
        time.sleep(0.1)
    assert proxy.swallowing is None  # the cleanup was lost indeed
