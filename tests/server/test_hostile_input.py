"""The hostile-input battery's findings, each as a regression test (in process: the real app, lifespan and
engine thread). Every answer is a JSON error in OpenAI's shape; the engine survives every one of them."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tests.helpers import assert_slots_balance, poison_sampling

from .test_app import sse_payloads


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error


def still_serving(client) -> None:
    body = {"prompt": "ROMEO.", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    assert assert_slots_balance(client.app.state.engine)["running_rows"] == 0


@pytest.mark.parametrize("fields,param", [
    ({"seed": 2**70}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": 2**64 - 1}, "seed"),
    ({"echo": 0}, "echo"), ({"prompt": [True]}, "prompt"), ({"top_k": 2**63}, "top_k"),
    ({"top_k": 5000}, "top_k"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": ""}, "stop"), ({"n": 2**70}, "n"), ({"max_tokens": 2**70}, "max_tokens"),
])
def test_out_of_range_fields_are_400_and_the_engine_lives(client, fields, param):
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **fields})
    assert error_of(response, 400)["param"] == param
    still_serving(client)


def test_extreme_but_valid_seeds_are_served(client):
    for seed, n in [(2**53, 2), (-(2**53), 1)]:
        body = {"prompt": "x", "max_tokens": 3, "seed": seed, "n": n, "temperature": 1.0, "ignore_eos": True}
        assert len(client.post("/v1/completions", json=body).json()["choices"]) == n
    still_serving(client)


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"prompt": "a\\ud800b"}'),
    ("/v1/completions", '{"prompt": "a", "stop": ["\\udfff"]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud83d"}]}'),
    ("/v1/sessions", '{"prompt": "\\ud800"}'),
])
def test_lone_surrogates_are_400_not_500(client, path, raw):
    response = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert error_of(response, 400)["param"]
    assert client.app.state.engine.registry.by_id == {}  # the session route created nothing
    still_serving(client)


def test_prompt_length_is_capped_before_and_after_tokenizing(make_client):
    client = make_client(max_prompt_tokens=64)
    long_text = "To be or not to be " * 2000  # far beyond 64 tokens by its byte length alone
    assert error_of(client.post("/v1/completions", json={"prompt": long_text}), 400)["code"] == "prompt_too_long"
    assert error_of(client.post("/v1/completions", json={"prompt": list(range(65))}), 400)["param"] == "prompt"
    borderline = "a b " * 40  # within the byte cap, over the token cap: counted after tokenizing
    assert "it has" in error_of(client.post("/v1/completions", json={"prompt": borderline}), 400)["message"]
    assert client.post("/v1/completions", json={"prompt": list(range(64)), "max_tokens": 1}).status_code == 200


def test_chunked_body_over_the_limit_is_413(make_client):
    client = make_client(max_body_bytes=4096)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(response, 413)["code"] == "body_too_large"


def test_stack_errors_are_json_with_the_right_allow(client):
    assert error_of(client.get("/no/such/route"), 404)
    response = client.put("/v1/sessions/sess-0123abc")
    error_of(response, 405)
    assert response.headers["allow"] == "DELETE, GET"
    response = client.request("OPTIONS", "/v1/completions")
    error_of(response, 405)
    assert response.headers["allow"] == "POST"


def test_an_unhandled_exception_is_a_json_500_with_a_request_id(client, monkeypatch):
    import linserve.server.api.common.chat as generation

    def broken(messages, tokenizer, tools=None):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(generation, "render_chat", broken)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    error = error_of(response, 500)
    assert response.headers["x-request-id"] in error["message"]
    still_serving(client)


def test_a_failing_step_is_a_500_or_an_error_event_and_the_server_goes_on(client, monkeypatch):
    poison_sampling(monkeypatch, 0.777)
    body = {"prompt": "ROMEO.", "max_tokens": 5, "temperature": 0.777}
    response = client.post("/v1/completions", json=body)
    error = error_of(response, 500)
    assert error["code"] == "engine_error" and response.headers["x-request-id"] in error["message"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        payloads = sse_payloads(stream)
    assert payloads[-1]["error"]["code"] == "engine_error"
    still_serving(client)


def test_a_dead_engine_turns_health_and_ready_to_503(client, monkeypatch):
    engine = client.app.state.engine

    def broken():
        raise RuntimeError("injected: corrupt scheduler")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    engine.counts()  # wake the loop
    deadline = __import__("time").monotonic() + 10
    while engine.alive and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.05)
    assert error_of(client.get("/health"), 503)
    assert error_of(client.get("/ready"), 503)
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert error_of(response, 503) and response.headers["retry-after"]
    assert error_of(client.post("/v1/sessions", json={}), 503)


def test_snapshots_beyond_what_a_model_can_produce_are_400(client):
    sid = client.post("/v1/sessions", json={"prompt": "ROMEO."}).json()["id"]
    data = client.get(f"/v1/sessions/{sid}/state").content
    tensors = st_load(data)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    metadata = header["__metadata__"]
    name = next(k for k in tensors if k.endswith(".S"))
    huge = {**tensors, name: tensors[name].clone().fill_(3e38)}
    negative_z = {**tensors}
    z = next(k for k in tensors if k.endswith(".z"))
    negative_z[z] = tensors[z].clone().fill_(-1.0)
    for bad_tensors, bad_meta, message in [
        (huge, metadata, "beyond"), (negative_z, metadata, "negative"),
        (tensors, {**metadata, "tokens": str(10**30)}, "tokens must be"),
        (tensors, {**metadata, "tokens": "-5"}, "tokens must be"),
    ]:
        response = client.post("/v1/sessions/import", content=st_save(bad_tensors, metadata=bad_meta))
        assert message in error_of(response, 400)["message"]
    assert client.post("/v1/sessions/import", content=data).status_code == 200


def test_logprobs_are_always_json_numbers():
    import torch

    from linserve.server.engine.sampling import LOGPROB_FLOOR, token_logprobs

    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    out = token_logprobs(logits, torch.tensor([1]), [2])[0]
    assert out.logprob == LOGPROB_FLOOR
    assert json.loads(json.dumps(out.logprob, allow_nan=False)) == LOGPROB_FLOOR  # strict JSON: no -Infinity


def test_invalid_session_prompt_creates_no_session(client):
    assert error_of(client.post("/v1/sessions", json={"prompt": [1, 10**9]}), 400)["param"] == "prompt"
    assert client.app.state.engine.registry.by_id == {}
    assert assert_slots_balance(client.app.state.engine)["slots_in_use"] == 0


def test_keys_are_required_for_the_docs_unless_public(make_client):
    closed = make_client(api_keys=["k1", "k2"])
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert error_of(closed.get(path), 401)
        assert closed.get(path, headers={"Authorization": "Bearer k2"}).status_code == 200
    assert error_of(closed.get("/v1/models", headers={"Authorization": "Bearer k3"}), 401)
    public = make_client(api_keys=["k1"], docs_public=True)
    assert public.get("/openapi.json").status_code == 200


def test_openapi_documents_what_the_server_answers(client):
    document = client.get("/openapi.json").json()
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and {"400", "401", "413", "429", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    state = document["paths"]["/v1/sessions/{session_id}/state"]["get"]["responses"]
    assert "application/octet-stream" in state["200"]["content"] and "404" in state
    request = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"maximum": len(client.app.state.tokenizer)}.items() <= request["top_k"].items()
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_full_session_tiers_answer_429_and_stateless_work_still_runs(make_client):
    client = make_client(num_slots=4, max_host_sessions=2, reserved_slots=1, max_n=1)
    created = [client.post("/v1/sessions", json={"prompt": f"Speaker {i}."}) for i in range(5)]
    assert all(r.status_code == 200 for r in created)
    refused = client.post("/v1/sessions", json={})
    assert error_of(refused, 429)["code"] == "capacity" and refused.headers["retry-after"]
    body = {"prompt": "ROMEO.", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for _ in range(3):  # stateless requests always find a slot
        assert client.post("/v1/completions", json=body).status_code == 200
    for response in created:  # and so does every session, from whichever tier it is in
        sid = response.json()["id"]
        assert client.post(f"/v1/sessions/{sid}/completions", json=body).status_code == 200
    assert error_of(client.post(f"/v1/sessions/{created[0].json()['id']}/fork"), 429)
    assert_slots_balance(client.app.state.engine)
