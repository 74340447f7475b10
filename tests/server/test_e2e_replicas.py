"""Two real `linserve serve` processes on one real redis-server: any replica continues any session, exactly
as one process would; one generation per session across replicas (409); Redis down → 503 for sessions only."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow

TURNS = [{"prompt": " and", "max_tokens": 6, "temperature": 0.8, "seed": 5, "ignore_eos": True,
          "repetition_penalty": 1.3},
         {"prompt": " so", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
         {"prompt": "\nKING.", "max_tokens": 7, "temperature": 0.9, "seed": 12, "ignore_eos": True,
          "presence_penalty": 0.8},
         {"prompt": " Yes", "max_tokens": 4, "temperature": 0, "ignore_eos": True}]


def _continue(base: str, sid: str, body: dict, key: str = "k1") -> str:
    response = httpx.post(f"{base}/v1/sessions/{sid}/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _create(base: str, key: str = "k1") -> str:
    response = httpx.post(f"{base}/v1/sessions", json={"prompt": "HAMLET.\nTo be"},
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


@pytest.fixture
def replicas(tiny_checkpoint, tmp_path, redis_url):
    url, redis = redis_url
    env = {"LINSERVE_SESSION_STORE": url}
    started = []
    try:
        for name in ("a", "b"):
            started.append(ServerProcess(tiny_checkpoint, tmp_path / f"{name}.log", "--api-key", "k1",
                                         "--api-key", "k2", env=env))
        yield started[0], started[1], redis
    finally:
        for process in started:
            process.stop()


def test_sessions_move_freely_between_replicas(replicas, tiny_checkpoint, tmp_path):
    a, b, _ = replicas
    alone = ServerProcess(tiny_checkpoint, tmp_path / "alone.log", "--api-key", "k1")  # dir store of its own
    try:
        reference = _create(alone.base)
        expected = [_continue(alone.base, reference, turn) for turn in TURNS]
    finally:
        alone.stop()
    sid = _create(a.base)
    got = [_continue((b, a)[i % 2].base, sid, turn) for i, turn in enumerate(TURNS)]  # B, A, B, A
    assert got == expected
    info = {r.base: httpx.get(f"{r.base}/v1/sessions/{sid}", headers={"Authorization": "Bearer k1"}).json()
            for r in (a, b)}
    assert info[a.base]["tokens"] == info[b.base]["tokens"]
    # the owner travels: another key sees no such session on either replica
    for replica in (a, b):
        assert httpx.get(f"{replica.base}/v1/sessions/{sid}", headers={"Authorization": "Bearer k2"}).status_code == 404
    # rewind on A, regenerate on B: the same last answer
    turns = httpx.get(f"{a.base}/v1/sessions/{sid}/turns", headers={"Authorization": "Bearer k1"}).json()
    back = httpx.post(f"{a.base}/v1/sessions/{sid}/rewind", json={"turn": turns[-2]["turn"]},
                      headers={"Authorization": "Bearer k1"})
    assert back.status_code == 200, back.text
    assert _continue(b.base, sid, TURNS[-1]) == expected[-1]
    # deleted through B: gone on A too
    assert httpx.delete(f"{b.base}/v1/sessions/{sid}", headers={"Authorization": "Bearer k1"}).status_code == 204
    assert httpx.get(f"{a.base}/v1/sessions/{sid}", headers={"Authorization": "Bearer k1"}).status_code == 404
    loads_only_for_a_missing_or_stale_copy(a, b)
    keyed_answers_hold_on_every_replica(a, b)
    every_response_on_every_replica(a, b)


def every_response_on_every_replica(a, b) -> None:
    """A conversation longer than a session record keeps (its newest 16 responses): every response made on A is
    retrieved on B — from its own entry in Redis — and a delete on B is seen by A."""
    from linserve.server.engine.sessions.records import APPLIED_KEPT

    headers, made, previous = {"Authorization": "Bearer k1"}, [], None
    for turn in range(APPLIED_KEPT + 3):
        body = {"input": f"line {turn}", "max_output_tokens": 2, "temperature": 0,
                **({"previous_response_id": previous} if previous else {})}
        response = httpx.post(f"{(a, b)[turn % 2].base}/v1/responses", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        made.append(response.json())
        previous = made[-1]["id"]
    first = httpx.get(f"{b.base}/v1/responses/{made[0]['id']}", headers=headers)
    assert first.status_code == 200 and first.json()["output"] == made[0]["output"]
    items = httpx.get(f"{a.base}/v1/responses/{made[1]['id']}/input_items", headers=headers).json()["data"]
    assert items[0]["content"][0]["text"] == "line 1"
    assert httpx.delete(f"{b.base}/v1/responses/{made[0]['id']}", headers=headers).status_code == 200
    assert httpx.get(f"{a.base}/v1/responses/{made[0]['id']}", headers=headers).status_code == 404


def keyed_answers_hold_on_every_replica(a, b) -> None:
    """An Idempotency-Key of a create, fork, import or delete answered by one replica is answered the same by
    the other (the answers are kept in the store, not only in the process that gave them)."""
    def call(replica, method: str, path: str, key: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": "Bearer k1", "Idempotency-Key": key}
        return httpx.request(method, f"{replica.base}{path}", headers=headers, timeout=60, **kwargs)

    made = call(a, "POST", "/v1/sessions", "make-x", json={"prompt": "HAMLET."})
    again = call(b, "POST", "/v1/sessions", "make-x", json={"prompt": "HAMLET."})
    assert again.json()["id"] == made.json()["id"] and again.headers["idempotent-replayed"] == "true"
    sid = made.json()["id"]
    forked = call(a, "POST", f"/v1/sessions/{sid}/fork", "fork-x")
    refork = call(b, "POST", f"/v1/sessions/{sid}/fork", "fork-x")
    assert refork.json()["id"] == forked.json()["id"] and refork.headers["idempotent-replayed"] == "true"
    state = httpx.get(f"{a.base}/v1/sessions/{sid}/state", headers={"Authorization": "Bearer k1"}).content
    imported = call(b, "POST", "/v1/sessions/import", "import-x", content=state)
    reimported = call(a, "POST", "/v1/sessions/import", "import-x", content=state)
    assert reimported.json()["id"] == imported.json()["id"] and reimported.headers["idempotent-replayed"] == "true"
    other = call(a, "POST", "/v1/sessions", "make-x", json={"prompt": "OTHELLO."})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert call(a, "DELETE", f"/v1/sessions/{sid}", "drop-x").status_code == 204
    redone = call(b, "DELETE", f"/v1/sessions/{sid}", "drop-x")
    assert redone.status_code == 204 and redone.headers["idempotent-replayed"] == "true"
    listed = httpx.get(f"{b.base}/v1/sessions", params={"limit": 100}, headers={"Authorization": "Bearer k1"})
    ids = {s["id"] for s in listed.json()["data"]}
    assert sid not in ids and forked.json()["id"] in ids and imported.json()["id"] in ids  # one of each made


def loads(replica) -> float:
    from tests.server.test_e2e_store_faults import metric

    return metric(replica.base, "linserve_session_store_loads_total")


def loads_only_for_a_missing_or_stale_copy(a, b) -> None:
    """linserve_session_store_loads_total (what session-affinity routing saves): a replica reads a session's
    record when it holds no copy, or another replica changed it since; never while its own copy is current."""
    sid = _create(a.base)
    before = {r.base: loads(r) for r in (a, b)}
    _continue(a.base, sid, TURNS[1])  # A made it: its copy is current
    _continue(a.base, sid, TURNS[1])
    assert loads(a) == before[a.base] and loads(b) == before[b.base]
    _continue(b.base, sid, TURNS[1])  # B never held it: one load
    _continue(b.base, sid, TURNS[1])  # now B's copy is current: none
    assert loads(b) == before[b.base] + 1 and loads(a) == before[a.base]
    _continue(a.base, sid, TURNS[1])  # B changed it: A's copy is stale, one load
    assert loads(a) == before[a.base] + 1


def test_one_generation_per_session_across_replicas_and_redis_outage(replicas):
    a, b, redis = replicas
    sid = _create(a.base)
    long = {"prompt": " x", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    results = {}

    def call(name, base):
        results[name] = httpx.post(f"{base}/v1/sessions/{sid}/completions", json=long, timeout=120,
                                   headers={"Authorization": "Bearer k1"})

    threads = [threading.Thread(target=call, args=(name, r.base)) for name, r in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    statuses = sorted(r.status_code for r in results.values())
    assert statuses == [200, 409], {n: (r.status_code, r.text[:200]) for n, r in results.items()}
    refused = next(r for r in results.values() if r.status_code == 409)
    assert refused.json()["error"]["param"] == "session_id"
    # Redis stopped: session routes answer 503 with Retry-After on both replicas; stateless serving goes on
    redis.kill()
    redis.wait(10)
    for replica in (a, b):
        response = httpx.post(f"{replica.base}/v1/sessions/{sid}/completions", json=TURNS[1], timeout=60,
                              headers={"Authorization": "Bearer k1"})
        assert response.status_code == 503 and "Retry-After" in response.headers, response.text
        assert "session store" in response.json()["error"]["message"]
        stateless = httpx.post(f"{replica.base}/v1/completions", json=TURNS[1], timeout=60,
                               headers={"Authorization": "Bearer k1"})
        assert stateless.status_code == 200, stateless.text
