"""The OpenAI API as real clients send it: content parts, `model`, parameters linserve does (not) implement."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_slots_balance

GREEDY_BODY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def chat(client, content, **extra):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], **GREEDY_BODY,
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
    body = {"prompt": "ROMEO.", **GREEDY_BODY}
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
    ({"functions": [], "echo_everything": True}, "echo_everything, functions"),
])
def test_unimplemented_parameters_are_refused_by_name(client, extra, named):
    response = client.post("/v1/completions", json={"prompt": "ROMEO.", **GREEDY_BODY, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert f"unsupported parameter{'s' if ',' in named else ''}: {named}" in error["message"]
    assert error["param"] == named.split(",")[0]  # the field, as README says


def test_harmless_and_neutral_parameters_are_accepted(client):
    body = {"prompt": "ROMEO.", **GREEDY_BODY, "user": "u-1", "metadata": {"k": "v"}, "best_of": 1, "suffix": "",
            "response_format": {"type": "text"}}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_logit_bias_steers_sampling(client):
    body = {"prompt": "ROMEO.", **GREEDY_BODY, "logprobs": 0}
    base = client.post("/v1/completions", json=body).json()["choices"][0]
    forced = client.post("/v1/completions", json={**body, "logit_bias": {"42": 100}}).json()["choices"][0]
    tokens = forced["logprobs"]["tokens"]
    assert len(set(tokens)) == 1 and forced["text"] == tokens[0] * 6  # +100 on one token: it wins every step
    assert forced["text"] != base["text"]


def test_logit_bias_is_validated(client):
    cases = [({"abc": 1}, "token ids"), ({"1": 101}, "[-100, 100]"), ({"999999": 1}, "outside the vocabulary")]
    for bias, message in cases:
        response = client.post("/v1/completions", json={"prompt": "ROMEO.", **GREEDY_BODY, "logit_bias": bias})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.json()
        assert response.json()["error"]["param"] == "logit_bias"


def test_logit_bias_keys_that_are_digits_only_to_unicode_are_a_400_on_every_route(client):
    """"²" and "①" pass str.isdigit but not int(); a 5,000-digit key passes both and exceeds int()'s limit."""
    session = client.post("/v1/sessions", json={}).json()["id"]
    routes = [("/v1/completions", {"prompt": "ROMEO."}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
              (f"/v1/sessions/{session}/completions", {"prompt": "ROMEO."})]
    for key in ("²", "①", "٣", "7" * 5000, "-1", " 1"):
        for path, body in routes:
            response = client.post(path, json={**body, "max_tokens": 1, "logit_bias": {key: 1}})
            assert response.status_code == 400, (path, key[:10], response.text[:200])
            assert response.json()["error"]["param"] == "logit_bias"
    assert client.get(f"/v1/sessions/{session}").json()["tokens"] == 0  # no refused request touched it


def test_a_chat_beyond_the_message_limit_is_a_400_before_anything_is_rendered(make_client):
    client = make_client(max_chat_messages=100)
    chat = {"messages": [{"role": "user", "content": "word"}] * 101}
    for path, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        response = client.post(path, json={**chat, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
        assert response.json()["error"]["code"] == "too_many_messages"
    chat["messages"] = chat["messages"][:100]
    assert client.post("/tokenize", json=chat).json()["count"] > 100


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


def test_the_docs_page_needs_nothing_but_this_server(client):
    """Swagger UI's script and stylesheet come from the installed package: /docs works offline."""
    import re

    for path in ("/docs", "/redoc"):
        page = client.get(path).text
        links = re.findall(r"""(?:src|href|url|spec-url)\s*[:=]\s*['"]([^'"]+)['"]""", page)
        assert links and all(link.startswith("/") for link in links), links  # no CDN, no other host
        for link in links:
            assert client.get(link).status_code == 200, link
    assert client.get("/docs/assets/swagger-ui-bundle.js").text.startswith(("/*", "!function", "(function"))
    assert client.get("/docs/assets/../app.py").status_code == 404


def test_tokenize_detokenize_version(client):
    ids = client.post("/tokenize", json={"prompt": "ROMEO. What light"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_prompt_tokens"] > 0
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "ROMEO. What light"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hail"}]}).json()
    assert chat["count"] > 1
    assert (
        client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).status_code
        == 400
    )
    bad = client.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    import torch
    import transformers

    from linserve.server.version import package_version

    version = client.get("/version").json()
    assert version["version"] == package_version() and version["torch"] == torch.__version__
    assert version["transformers"] == transformers.__version__ and version["device"] in ("cpu", "cuda:0", "cuda")
    engine = client.app.state.engine  # the count is per thread in OpenMP: the engine thread's is the one that counts
    engine_threads = engine.commands.call(torch.get_num_threads).result()
    assert version["threads"] == engine_threads == version["cpu_threads"]["threads"]
    assert version["cpu_threads"]["source"] in ("default", "setting") and version["cpu_threads"]["usable_cpus"] > 0
    assert version["dtype"] == "float32"
    from linserve.model import kernels

    assert version["projections"] == {"kernel": kernels.form() if kernels.load() else "onednn", "weights": "bf16"}
    assert version["decode_step"]["compile"] == "off" and version["decode_step"]["verdict"] is None


# ---------------------------------------------------------------- a batch of prompts in /v1/completions
PROMPTS = ["ROMEO.", "JULIET. O Romeo", "Enter"]


def completion(client, prompt, **extra):
    response = client.post("/v1/completions", json={"prompt": prompt, **GREEDY_BODY, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_batch_of_prompts_gives_each_prompts_own_choices_in_order(client):
    alone = [completion(client, p, n=2, temperature=0.9, seed=7) for p in PROMPTS]
    batch = completion(client, PROMPTS, n=2, temperature=0.9, seed=7)
    assert [c["index"] for c in batch["choices"]] == list(range(6))  # index = prompt × n + row
    for p, single in enumerate(alone):
        for row in range(2):
            assert batch["choices"][p * 2 + row]["text"] == single["choices"][row]["text"]
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in alone)
    assert batch["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in alone) == 36
    assert_slots_balance(client.app.state.engine)


def test_a_batch_of_token_id_lists_equals_the_batch_of_texts(client):
    ids = [client.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]
    texts = completion(client, PROMPTS, echo=True)
    tokens = completion(client, ids, echo=True)
    assert [c["text"] for c in tokens["choices"]] == [c["text"] for c in texts["choices"]]
    assert all(c["text"].startswith(p) for c, p in zip(texts["choices"], PROMPTS))  # echo: each its own prompt


def sse(response) -> list[dict]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_streamed_batch_merges_every_prompts_rows(client, logprobs):
    body = {
        "prompt": PROMPTS,
        **GREEDY_BODY,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": logprobs,
    }
    chunks = sse(client.post("/v1/completions", json=body))
    whole = completion(client, PROMPTS, n=2)
    texts, finishes = ["" for _ in range(6)], [[] for _ in range(6)]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]].append(choice["finish_reason"])  # the key is always there: null until the end
    assert texts == [c["text"] for c in whole["choices"]]
    assert all(f[-1] == "length" and set(f[:-1]) == {None} for f in finishes), finishes
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_chat_stream_chunks_carry_a_null_finish_reason_until_the_last(client):
    for extra in ({}, {"logprobs": True, "top_logprobs": 1}):
        body = {"messages": [{"role": "user", "content": "Hail"}], **GREEDY_BODY, "stream": True, **extra}
        choices = [c["choices"][0] for c in sse(client.post("/v1/chat/completions", json=body))]
        assert choices[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]


def test_batch_limits_are_clear_400s(make_client):
    client = make_client(max_prompts_per_request=2)
    too_many = client.post("/v1/completions", json={"prompt": PROMPTS, **GREEDY_BODY})
    assert too_many.status_code == 400 and "at most 2 prompts" in too_many.json()["error"]["message"]
    session = client.post("/v1/sessions", json={}).json()["id"]
    batch = client.post(f"/v1/sessions/{session}/completions", json={"prompt": ["a", "b"], **GREEDY_BODY})
    assert batch.status_code == 400 and "one prompt" in batch.json()["error"]["message"]
    mixed = client.post("/v1/completions", json={"prompt": ["a", [1, 2]], **GREEDY_BODY})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"
    long = client.post("/v1/completions", json={"prompt": ["a", "b " * 200_000], **GREEDY_BODY})
    assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
    assert_slots_balance(client.app.state.engine)
