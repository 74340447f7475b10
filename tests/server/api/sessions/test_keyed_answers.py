"""Idempotency-Key answers of create, fork, import and delete outlive the process that gave them (kept in the
session store): a retry after a restart gets the first answer, not a second session."""

from __future__ import annotations


def keyed(client, method: str, path: str, key: str, **kwargs):
    return client.request(method, path, headers={"Idempotency-Key": key}, **kwargs)


def test_keyed_answers_survive_a_restart(make_client, tmp_path):
    store = f"dir:{tmp_path / 'store'}"
    client = make_client(session_store=store)
    made = keyed(client, "POST", "/v1/sessions", "make-1", json={"prompt": "HAMLET."}).json()
    forked = keyed(client, "POST", f"/v1/sessions/{made['id']}/fork", "fork-1").json()
    doomed = client.post("/v1/sessions", json={}).json()["id"]
    assert keyed(client, "DELETE", f"/v1/sessions/{doomed}", "drop-1").status_code == 204
    client.__exit__(None, None, None)
    again = make_client(session_store=store)
    remade = keyed(again, "POST", "/v1/sessions", "make-1", json={"prompt": "HAMLET."})
    assert remade.json()["id"] == made["id"] and remade.headers["idempotent-replayed"] == "true"
    refork = keyed(again, "POST", f"/v1/sessions/{made['id']}/fork", "fork-1")
    assert refork.json()["id"] == forked["id"] and refork.headers["idempotent-replayed"] == "true"
    redrop = keyed(again, "DELETE", f"/v1/sessions/{doomed}", "drop-1")
    assert redrop.status_code == 204 and redrop.headers["idempotent-replayed"] == "true"
    assert {s["id"] for s in again.get("/v1/sessions").json()["data"]} == {made["id"], forked["id"]}
    reused = keyed(again, "POST", "/v1/sessions", "make-1", json={"prompt": "OTHELLO."})
    assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"


def test_a_key_whose_session_was_deleted_applies_anew_after_a_restart(make_client, tmp_path):
    store = f"dir:{tmp_path / 'store'}"
    client = make_client(session_store=store)
    made = keyed(client, "POST", "/v1/sessions", "make-2", json={}).json()["id"]
    assert client.delete(f"/v1/sessions/{made}").status_code == 204
    client.__exit__(None, None, None)
    again = make_client(session_store=store)
    anew = keyed(again, "POST", "/v1/sessions", "make-2", json={})
    assert anew.status_code == 200 and anew.json()["id"] != made and "idempotent-replayed" not in anew.headers
