"""Every stored response of a conversation is retrievable for the conversation's whole life (its own store entry,
not only the newest 16 its session's record keeps), within `session_responses_mb`, which says so when full."""

from __future__ import annotations

from linserve.server.engine.sessions.records import APPLIED_KEPT

TURNS = APPLIED_KEPT + 4
GREEDY = {"temperature": 0, "max_output_tokens": 2}


def chain(client, turns: int) -> list[dict]:
    responses, previous = [], None
    for turn in range(turns):
        body = {"input": f"line {turn}", **GREEDY, **({"previous_response_id": previous} if previous else {})}
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        responses.append(response.json())
        previous = responses[-1]["id"]
    return responses


def test_the_first_response_of_a_long_conversation_is_retrievable_after_a_restart(make_client, tmp_path):
    store = f"dir:{tmp_path / 'store'}"
    client = make_client(session_store=store)
    responses = chain(client, TURNS)
    first, second = responses[0], responses[1]
    got = client.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json()["output"] == first["output"]
    assert got.json()["usage"] == first["usage"]
    items = client.get(f"/v1/responses/{first['id']}/input_items").json()["data"]
    assert items[0]["content"][0]["text"] == "line 0"
    assert client.delete(f"/v1/responses/{second['id']}").json()["deleted"] is True
    assert client.get(f"/v1/responses/{second['id']}").status_code == 404
    assert client.delete(f"/v1/responses/{second['id']}").status_code == 404  # gone is gone
    client.__exit__(None, None, None)  # stop the server; a new one on the same store
    again = make_client(session_store=store)
    assert again.get(f"/v1/responses/{first['id']}").json()["output"] == first["output"]
    assert again.get(f"/v1/responses/{second['id']}").status_code == 404
    latest = again.get(f"/v1/responses/{responses[-1]['id']}").json()
    assert latest["output"] == responses[-1]["output"]


def test_a_conversation_past_its_budget_says_so(make_client):
    client = make_client(session_responses_mb=0.004)  # ~4 KB: a few responses' entries
    responses = chain(client, TURNS + 4)
    assert client.get(f"/v1/responses/{responses[0]['id']}").status_code == 200  # within the budget: kept
    missing = [r for r in responses if client.get(f"/v1/responses/{r['id']}").status_code == 404]
    assert missing and missing[-1] is not responses[-1]  # the newest stay retrievable from the record
    error = client.get(f"/v1/responses/{missing[0]['id']}").json()["error"]
    assert "session_responses_mb" in error["message"] and error["code"] == "not_found"
    # the conversation itself goes on
    follow = client.post("/v1/responses", json={"input": "more", **GREEDY, "previous_response_id": responses[-1]["id"]})
    assert follow.status_code == 200


def test_without_a_store_the_newest_are_kept_in_memory(make_client):
    client = make_client(session_store="none")
    responses = chain(client, TURNS)
    assert client.get(f"/v1/responses/{responses[-1]['id']}").status_code == 200
    assert client.get(f"/v1/responses/{responses[0]['id']}").status_code == 404
