"""Every route and error path, in process (the app, its lifespan and engine thread, an httpx client)."""

from __future__ import annotations

import json

import pytest


def sse_payloads(response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_health_ready_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "linserve-shakespeare"


def test_completion_non_streaming_with_usage_and_logprobs(client):
    body = {"prompt": "ROMEO.", "max_tokens": 7, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    data = client.post("/v1/completions", json=body).json()
    choice = data["choices"][0]
    assert data["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 7
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 7
    assert len(choice["logprobs"]["token_logprobs"]) == 7
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    again = client.post("/v1/completions", json=body).json()
    assert again["choices"][0]["text"] == choice["text"]  # greedy is deterministic


def test_completion_streaming_matches_non_streaming(client):
    body = {"prompt": "JULIET.", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == whole
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 9
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_n_and_seed(client):
    body = {"prompt": "To be", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()
    second = client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert sorted(c["index"] for c in first["choices"]) == [0, 1, 2]


def test_chat_completion_both_ways(client):
    body = {"messages": [{"role": "user", "content": "Speak, friend."}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    data = client.post("/v1/chat/completions", json=body).json()
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["role"] == "assistant"
    assert len(data["choices"][0]["logprobs"]["content"]) == 5
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        payloads = sse_payloads(response)
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads)
    assert text == data["choices"][0]["message"]["content"]


def test_session_lifecycle(client):
    created = client.post("/v1/sessions", json={"prompt": "HAMLET.\nTo be, or not to be"}).json()
    sid = created["id"]
    assert created["tokens"] > 0 and created["state_bytes"] > 0
    detail = client.get(f"/v1/sessions/{sid}").json()
    assert detail["tier"] in ("device", "host") and detail["tokens"] == created["tokens"]
    greedy = {"prompt": "", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    first = client.post(f"/v1/sessions/{sid}/completions", json=greedy).json()["choices"][0]["text"]
    fork = client.post(f"/v1/sessions/{sid}/fork").json()["id"]
    snapshot = client.get(f"/v1/sessions/{sid}/state")
    assert snapshot.headers["content-type"] == "application/octet-stream"
    imported = client.post("/v1/sessions/import", content=snapshot.content,
                           headers={"content-type": "application/octet-stream"}).json()["id"]
    texts = [
        client.post(f"/v1/sessions/{s}/completions", json={**greedy, "prompt": " and"}).json()["choices"][0]["text"]
        for s in (sid, fork, imported)
    ]
    assert texts[0] == texts[1] == texts[2]
    assert client.get(f"/v1/sessions/{sid}").json()["tokens"] > created["tokens"] + len(first) // 10
    assert client.delete(f"/v1/sessions/{sid}").status_code == 204
    assert client.get(f"/v1/sessions/{sid}").status_code == 404


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "n": 99}, "n"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": [1, 2, 10_000_000]}, "prompt"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_values_are_400_with_param(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_is_400(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_unknown_session_is_404(client):
    assert client.get("/v1/sessions/sess-missing").status_code == 404
    assert client.post("/v1/sessions/sess-missing/completions", json={"prompt": "x"}).status_code == 404
    assert client.delete("/v1/sessions/sess-missing").status_code == 404
    assert client.post("/v1/sessions/sess-missing/fork").json()["error"]["type"] == "not_found_error"


def test_bad_snapshot_is_400(client):
    response = client.post("/v1/sessions/import", content=b"garbage" * 10)
    assert response.status_code == 400 and "snapshot" in response.json()["error"]["message"]


def test_body_over_limit_is_413(make_client):
    client = make_client(max_body_bytes=2048)
    response = client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_api_keys_and_session_ownership(make_client):
    client = make_client(api_keys=["key-a", "key-b"])
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    assert client.get("/ready").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert (
        client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    sid = client.post("/v1/sessions", json={}, headers=a).json()["id"]
    assert client.get(f"/v1/sessions/{sid}", headers=a).status_code == 200
    assert client.get(f"/v1/sessions/{sid}", headers=b).status_code == 404
    assert client.delete(f"/v1/sessions/{sid}", headers=b).status_code == 404


def test_metrics_names_and_itl_by_context(client):
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in [
        "linserve_time_to_first_token_seconds",
        "linserve_inter_token_latency_seconds",
        "linserve_e2e_request_latency_seconds",
        "linserve_queue_wait_seconds",
        "linserve_engine_step_seconds",
        "linserve_batch_size",
        "linserve_requests_total",
        "linserve_requests_finished_total",
        "linserve_prompt_tokens_total",
        "linserve_generation_tokens_total",
        "linserve_requests_running",
        "linserve_requests_waiting",
        "linserve_sessions",
        "linserve_state_bytes_per_session",
        "linserve_state_pool_bytes",
        "linserve_prefix_cache_queries_total",
        "linserve_prefix_cache_hits_total",
    ]:
        assert f"# TYPE {name}" in text, name
    assert 'linserve_inter_token_latency_seconds_count{context="0-1k"} 4.0' in text
    assert 'linserve_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert "linserve_generation_tokens_total 5.0" in text


def test_softmax_checkpoint_is_served_with_a_kv_cache(small_tokenizer, tmp_path):
    import torch
    from fastapi.testclient import TestClient

    from linserve.model import LinearGPT, ModelConfig
    from linserve.model.training.trainer import save_checkpoint
    from linserve.server.app import create_app
    from linserve.server.settings import Settings

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=small_tokenizer.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, attention="softmax"
    )
    save_checkpoint(LinearGPT(config), small_tokenizer, tmp_path, torch.float32)
    settings = Settings(model=str(tmp_path), device="cpu", num_slots=4, max_context=64, api_servers=0)
    with TestClient(create_app(settings)) as client:
        ok = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 5, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        too_long = client.post("/v1/completions", json={"prompt": "x " * 40, "max_tokens": 40})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        assert client.post("/v1/sessions", json={}).status_code == 400
        assert "linserve_state_bytes_per_session" in client.get("/metrics").text


def test_turns_and_rewind_regenerate_the_last_answer(client):
    sid = client.post("/v1/sessions", json={"prompt": "HAMLET.\n"}).json()["id"]
    ask = {"prompt": "To be", "max_tokens": 8, "temperature": 0.9, "seed": 3, "ignore_eos": True}
    first = client.post(f"/v1/sessions/{sid}/completions", json=ask).json()["choices"][0]["text"]
    client.post(f"/v1/sessions/{sid}/completions", json={**ask, "prompt": " or not"})
    turns = client.get(f"/v1/sessions/{sid}/turns").json()
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["tokens"] < turns[1]["tokens"] < turns[2]["tokens"]
    # "regenerate the answer to turn 2": back to turn 1, ask again — same seed, same answer
    detail = client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 1}).json()
    assert detail["tokens"] == turns[0]["tokens"] and detail["id"] == sid
    again = client.post(f"/v1/sessions/{sid}/completions", json=ask).json()["choices"][0]["text"]
    assert again == first
    assert [t["turn"] for t in client.get(f"/v1/sessions/{sid}/turns").json()] == [1, 2]
    bad = client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "turn"
    assert client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 0}).status_code == 400
    assert client.post("/v1/sessions/sess-unknown/rewind", json={"turn": 1}).status_code == 404


def test_a_started_app_serves_with_startups_objects_frozen_and_gives_them_back_when_it_ends(tiny_checkpoint):
    """engine/heap.py: a full collection walks only what serving made (startup's ~250,000 objects cost 150 ms a
    walk); an app that ends unfreezes them, so a process that starts servers again can free their cycles."""
    import gc

    from fastapi.testclient import TestClient

    from linserve.server.app import create_app
    from linserve.server.settings import Settings
    from tests.devices import device_name_under_test

    settings = Settings(model=str(tiny_checkpoint), device=device_name_under_test(), num_slots=2, compile="off",
                        api_servers=0, session_store="none")
    with TestClient(create_app(settings)) as client:
        assert gc.get_freeze_count() > 10_000
        ok = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200
    assert gc.get_freeze_count() == 0
