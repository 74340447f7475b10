"""The OpenAI API as real clients send it: content parts, `model`, parameters linserve does (not) implement."""

from __future__ import annotations

import pytest

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def chat(client, content, **extra):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], **GREEDY,
                                                     **extra})


def test_chat_content_as_text_parts_equals_a_string(client):
    whole = chat(client, "Good morrow, sir.").json()["choices"][0]["message"]["content"]
    parts = [{"type": "text", "text": "Good morrow, "}, {"type": "text", "text": "sir."}]
    assert chat(client, parts).json()["choices"][0]["message"]["content"] == whole


def test_non_text_content_parts_are_a_clear_400(client):
    response = chat(client, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert response.status_code == 400
    assert "'image_url'" in response.json()["error"]["message"] and "text only" in response.json()["error"]["message"]


def test_model_omitted_or_served_is_fine_and_another_is_404(client):
    served = client.get("/v1/models").json()["data"][0]["id"]
    body = {"prompt": "ROMEO.", **GREEDY}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "model": served}).status_code == 200
    for response in (client.post("/v1/completions", json={**body, "model": "gpt-4o"}),
                     chat(client, "Hail", model="gpt-4o")):
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4o" in error["message"]


@pytest.mark.parametrize("extra, named", [
    ({"best_of": 3}, "best_of"),
    ({"suffix": "THE END"}, "suffix"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [], "echo_everything": True}, "echo_everything, functions"),
])
def test_unimplemented_parameters_are_refused_by_name(client, extra, named):
    response = client.post("/v1/completions", json={"prompt": "ROMEO.", **GREEDY, **extra})
    assert response.status_code == 400
    assert f"unsupported parameter{'s' if ',' in named else ''}: {named}" in response.json()["error"]["message"]


def test_harmless_and_neutral_parameters_are_accepted(client):
    body = {"prompt": "ROMEO.", **GREEDY, "user": "u-1", "metadata": {"k": "v"}, "best_of": 1, "suffix": "",
            "response_format": {"type": "text"}}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_logit_bias_steers_sampling(client):
    body = {"prompt": "ROMEO.", **GREEDY, "logprobs": 0}
    base = client.post("/v1/completions", json=body).json()["choices"][0]
    forced = client.post("/v1/completions", json={**body, "logit_bias": {"42": 100}}).json()["choices"][0]
    tokens = forced["logprobs"]["tokens"]
    assert len(set(tokens)) == 1 and forced["text"] == tokens[0] * 6  # +100 on one token: it wins every step
    assert forced["text"] != base["text"]


def test_logit_bias_is_validated(client):
    cases = [({"abc": 1}, "token ids"), ({"1": 101}, "[-100, 100]"), ({"999999": 1}, "outside the vocabulary")]
    for bias, message in cases:
        response = client.post("/v1/completions", json={"prompt": "ROMEO.", **GREEDY, "logit_bias": bias})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.json()
        assert response.json()["error"]["param"] == "logit_bias"


def test_metrics_carry_process_metrics(client):
    text = client.get("/metrics").text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert f"\n{name} " in text, name


def test_docs_are_counted_under_their_own_endpoint_names(client):
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert client.get(path).status_code == 200
    text = client.get("/metrics").text
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert f'linserve_requests_total{{endpoint="{path}",status="200"}} 1.0' in text, path


def test_tokenize_detokenize_version(client):
    ids = client.post("/tokenize", json={"prompt": "ROMEO. What light"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_prompt_tokens"] > 0
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "ROMEO. What light"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hail"}]}).json()
    assert chat["count"] > 1
    assert client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).status_code == 400
    bad = client.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    from server.version import package_version

    assert client.get("/version").json() == {"version": package_version()}
