"""GET /v1/sessions over HTTP: each API key sees its own sessions, pages follow `after`, bad parameters are
clear 400s, and a listing taken while sessions are created and deleted concurrently stays consistent."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.helpers import assert_slots_balance


def listing(client, headers=None, **params):
    response = client.get("/v1/sessions", params=params, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.json()


def every_id(client, headers=None, limit=2, order="desc") -> list[str]:
    ids, after = [], None
    while True:
        page = listing(client, headers, limit=limit, order=order, **({"after": after} if after else {}))
        ids += [s["id"] for s in page["data"]]
        if not page["has_more"]:
            return ids
        assert page["last_id"] == page["data"][-1]["id"] and page["first_id"] == page["data"][0]["id"]
        after = page["last_id"]


def test_each_key_lists_its_own_sessions_page_by_page(make_client):
    client = make_client(api_keys=["key-a", "key-b"])
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    mine = [client.post("/v1/sessions", json={"prompt": "Hail"}, headers=a).json()["id"] for _ in range(5)]
    theirs = client.post("/v1/sessions", json={}, headers=b).json()["id"]
    assert every_id(client, a) == mine[::-1] and every_id(client, a, order="asc") == mine
    assert every_id(client, b) == [theirs]
    first = listing(client, a, limit=1)["data"][0]
    assert first["id"] == mine[-1] and first["tier"] == "device" and first["tokens"] > 0
    assert set(first) == {"id", "tokens", "state_bytes", "tier", "created", "last_used", "revision"}
    assert client.get("/v1/sessions").status_code == 401
    empty = listing(client, b, after=theirs)
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize("params, param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "many"}, "limit"),
    ({"order": "newest"}, "order"), ({"after": "../../etc/passwd"}, "after"), ({"after": "sess-" + "a" * 200}, "after"),
])
def test_bad_listing_parameters_are_clear_400s(client, params, param):
    response = client.get("/v1/sessions", params=params)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_listing_under_concurrent_creates_and_deletes_stays_consistent(make_client):
    client = make_client(num_slots=8, max_host_sessions=64)
    kept = [client.post("/v1/sessions", json={}).json()["id"] for _ in range(6)]

    def churn(i: int) -> str:
        session = client.post("/v1/sessions", json={"prompt": f"x{i}"}).json()["id"]
        assert client.delete(f"/v1/sessions/{session}").status_code == 204
        return session

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        churning = [pool.submit(churn, i) for i in range(24)]
        snapshots = [every_id(client, limit=3) for _ in range(5)]  # taken while the others churn
        gone = {future.result() for future in churning}
    for ids in snapshots:  # no duplicate, never out of order, the kept ones always there
        assert len(ids) == len(set(ids)) and ids == sorted(ids, reverse=True) and set(kept) <= set(ids)
    assert every_id(client) == kept[::-1] and not gone & set(every_id(client))
    assert_slots_balance(client.app.state.engine)


def test_usage_counts_exactly_the_tokens_each_call_added_to_the_session(client):
    """Issue 31 row 11: an empty session's first call starts from end-of-text — one prompt token, not zero —
    and in every path (non-streamed, streamed with usage, empty and non-empty prompts) the session grows by
    exactly the call's usage.total_tokens."""
    import json

    sid = client.post("/v1/sessions", json={}).json()["id"]
    tokens = client.get(f"/v1/sessions/{sid}").json()["tokens"]
    assert tokens == 0
    calls = [({"prompt": "", "max_tokens": 3}, 1), ({"prompt": " and so", "max_tokens": 2}, None),
             ({"prompt": "", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}, 0),
             ({"prompt": " to", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}, None)]
    for body, prompt_tokens in calls:
        response = client.post(f"/v1/sessions/{sid}/completions", json={"temperature": 0, "ignore_eos": True, **body})
        assert response.status_code == 200, response.text
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            usage = next(e["usage"] for e in events if e.get("usage"))
        else:
            usage = response.json()["usage"]
        if prompt_tokens is not None:
            assert usage["prompt_tokens"] == prompt_tokens, (body, usage)
        assert usage["completion_tokens"] == body["max_tokens"]
        grown = client.get(f"/v1/sessions/{sid}").json()["tokens"]
        assert grown - tokens == usage["total_tokens"], (body, usage)
        tokens = grown
