"""Scoring: with `echo` and `logprobs`, the prompt's own tokens carry their logprobs (the first null) — for text
and token-id prompts, batches, streams, `max_tokens: 0`, session continuations and prompts the prefix cache
already holds — and they are the model's own log-softmax, across prefill-chunk boundaries."""

from __future__ import annotations

import json

import pytest
import torch

from linserve.model.loading import load_model
from tests.helpers import assert_slots_balance

PASSAGE = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
           "Arise, fair sun, and kill the envious moon.")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint, torch.device("cpu"), torch.float32).model


@pytest.fixture(scope="module")
def offline(tiny):
    """Token ids → each token's log-probability given the ones before (the first has none), by one forward."""

    def logprobs(ids: list[int]) -> list[float | None]:
        with torch.inference_mode():
            logits, _ = tiny(torch.tensor([ids]))  # (1, T, V)
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # (T, V)
        return [None] + logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    return logprobs


def greedy(model, ids: list[int], count: int) -> list[int]:
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(count):
            logits, _ = model(torch.tensor([ids]))  # (1, T, V)
            ids.append(int(logits[0, -1].argmax()))
    return ids[-count:]


def tokenize(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text}).json()["tokens"]


def score(client, prompt, url="/v1/completions", **extra) -> dict:
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0, **extra}
    response = client.post(url, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_matches(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want) and (got[0] is None) == (want[0] is None)
    torch.testing.assert_close(torch.tensor([g for g in got if g is not None]),
                               torch.tensor([w for w in want if w is not None]), rtol=0, atol=1e-4)


def test_prompt_tokens_carry_the_models_own_logprobs_across_chunk_boundaries(client, offline):
    ids = tokenize(client, PASSAGE)
    assert len(ids) > 3 * 16  # max_prefill_chunk is 16 here: several chunks, several boundaries
    for prompt in (PASSAGE, ids):
        choice = score(client, prompt)["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == PASSAGE and choice["finish_reason"] == "length"
        assert lp["tokens"] == [client.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids]
        assert_matches(lp["token_logprobs"], offline(ids))
        assert lp["top_logprobs"][0] is None and all(len(top) <= 2 for top in lp["top_logprobs"][1:])
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert max(top.values()) >= value - 1e-6  # the best alternative is at least as likely
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert_slots_balance(client.app.state.engine)


def test_a_generated_token_follows_the_scored_prompt(client, offline):
    ids = tokenize(client, PASSAGE)
    lp = score(client, ids, max_tokens=1)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # what lm-eval reads: prompt, then the one generated token
    assert_matches(lp["token_logprobs"][: len(ids)], offline(ids))
    assert lp["text_offset"][-1] == len(PASSAGE)
    plain = client.post("/v1/completions", json={"prompt": ids, "logprobs": 2, "max_tokens": 1, "temperature": 0})
    assert plain.json()["choices"][0]["logprobs"]["tokens"] == lp["tokens"][-1:]  # no echo: generated only


def test_a_batch_with_n_gives_each_choice_its_own_prompts_logprobs(client, offline):
    prompts = [PASSAGE, "JULIET. O Romeo, Romeo, wherefore art thou Romeo?"]
    choices = score(client, prompts, n=2, max_tokens=2, temperature=0.8, seed=3)["choices"]
    assert len(choices) == 4
    for index, choice in enumerate(choices):
        ids = tokenize(client, prompts[index // 2])
        assert_matches(choice["logprobs"]["token_logprobs"][: len(ids)], offline(ids))
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 2
    assert_slots_balance(client.app.state.engine)


def test_a_stream_sends_the_echo_with_its_logprobs_then_the_tokens(client):
    ids = tokenize(client, PASSAGE)
    body = {"prompt": PASSAGE, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line)["choices"][0] for line in lines[:-1]]
    first = events[0]
    assert first["text"].startswith(PASSAGE) and len(first["logprobs"]["tokens"]) == len(ids) + 1
    streamed = {"text": "".join(e["text"] for e in events),
                "token_logprobs": sum((e["logprobs"]["token_logprobs"] for e in events), []),
                "text_offset": sum((e["logprobs"]["text_offset"] for e in events), [])}
    whole = score(client, PASSAGE, logprobs=1, max_tokens=3)["choices"][0]
    assert streamed["text"] == whole["text"]
    assert_matches(streamed["token_logprobs"], whole["logprobs"]["token_logprobs"])
    assert streamed["text_offset"] == whole["logprobs"]["text_offset"]  # positions in the whole text


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_are_positions_in_the_whole_returned_text(client, echo):
    """Issue 31 row 12: a streamed choice's `text_offset` continues across events (it restarted at 0 in every
    event), equal to the non-streamed response's, with and without an echoed prompt."""
    body = {"prompt": PASSAGE, "echo": echo, "logprobs": 2, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line)["choices"][0] for line in lines[:-1]]
    offsets = sum((e["logprobs"]["text_offset"] for e in events if e["logprobs"]), [])
    tokens = sum((e["logprobs"]["tokens"] for e in events if e["logprobs"]), [])
    assert "".join(e["text"] for e in events) == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] > offsets[0]
    if not echo:
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_a_prompt_in_the_prefix_cache_is_still_scored_whole(make_client, offline):
    client = make_client(prefix_cache_entries=8)
    ids = tokenize(client, PASSAGE)
    for _ in range(2):  # the second would start from the cached prefix
        client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert_matches(score(client, ids)["choices"][0]["logprobs"]["token_logprobs"], offline(ids))


def test_a_session_continuation_is_scored_given_the_sessions_history(client, offline, tiny):
    """The new prompt's first token has a logprob too: the history predicts it. Both ways a session can stand
    before a turn: after a prompt (its logits stored) and after generating (its last token still pending)."""
    head, tail = tokenize(client, "ROMEO. But soft, what light"), tokenize(client, " through yonder window breaks?")
    session = client.post("/v1/sessions", json={"prompt": head}).json()["id"]
    url = f"/v1/sessions/{session}/completions"
    lp = score(client, tail, url=url)["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is not None
    assert_matches(lp["token_logprobs"], offline(head + tail)[len(head):])

    generated = client.post(url, json={"prompt": [], "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
    history = head + tail + greedy(tiny, head + tail, 5)
    assert generated["choices"][0]["text"] == client.post("/detokenize", json={"tokens": history[-5:]}).json()["prompt"]
    assert len(history) == client.get(f"/v1/sessions/{session}").json()["tokens"]
    lp = score(client, tail, url=url)["choices"][0]["logprobs"]
    assert_matches(lp["token_logprobs"], offline(history + tail)[len(history):])
    assert_slots_balance(client.app.state.engine)


def completion(client, body: dict, stream: bool) -> dict:
    """The choice's text and logprobs, joined across events when streamed."""
    if not stream:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return {"text": choice["text"], **{k: choice["logprobs"][k] for k in ("tokens", "text_offset")}}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line)["choices"][0] for line in lines[:-1]]
    return {"text": "".join(e["text"] for e in events),
            **{k: sum((e["logprobs"][k] for e in events), []) for k in ("tokens", "text_offset")}}


SAMPLED = {"prompt": PASSAGE, "logprobs": 1, "max_tokens": 16, "temperature": 1.0, "seed": 7, "ignore_eos": True}


def first_clean_split(free: dict, start: str = "") -> int:
    """A token index k > 0 where `start` + tokens k and k+1 first occur in the text exactly at token k's
    offset (so a stop string made of them cuts the text there)."""
    for k in range(1, len(free["tokens"]) - 1):
        stop = start + free["tokens"][k] + free["tokens"][k + 1]
        if len(stop) > 1 and free["text"].find(stop) == free["text_offset"][k] - len(start):
            return k
    raise AssertionError(f"no token pair to stop on in {free['text']!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_strings_tokens_are_not_in_the_logprobs(client, stream):
    """Issue 31 row 12: logprobs cover exactly the returned text. A stop string made of two whole tokens cuts
    them from the text and from the logprobs (they stayed there, streamed or not); the tokens before it keep
    their offsets."""
    free = completion(client, SAMPLED, stream)
    k = first_clean_split(free)
    got = completion(client, {**SAMPLED, "stop": [free["tokens"][k] + free["tokens"][k + 1]]}, stream)
    assert got["text"] == "".join(free["tokens"][:k])
    assert got["tokens"] == free["tokens"][:k] and got["text_offset"] == free["text_offset"][:k]


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_straddling_the_stop_string_stays(client, stream):
    """A token whose text is partly returned keeps its entry: the stop string starts at the last character of
    token k-1 (its other characters are returned)."""
    free = completion(client, SAMPLED, stream)
    k = next(k for k in range(2, len(free["tokens"]) - 1) if len(free["tokens"][k - 1]) > 1
             and free["text"].find(free["tokens"][k - 1][-1] + free["tokens"][k] + free["tokens"][k + 1])
             == free["text_offset"][k] - 1)
    stop = free["tokens"][k - 1][-1] + free["tokens"][k] + free["tokens"][k + 1]
    got = completion(client, {**SAMPLED, "stop": [stop]}, stream)
    assert got["text"] == "".join(free["tokens"][:k])[:-1]
    assert got["tokens"] == free["tokens"][:k] and got["text_offset"] == free["text_offset"][:k]


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_echoed_prompt_puts_the_first_token_at_0(client, stream):
    """Issue 31 row 12: an empty prompt is end-of-text (scored: no logprob) and returns no text, so the first
    generated token starts at offset 0 of the returned text; every token's text is where its offset says."""
    body = {"prompt": "", "echo": True, "logprobs": 1, "max_tokens": 24, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    got = completion(client, body, stream)
    assert got["tokens"][0] == "<|endoftext|>" and got["text_offset"][:2] == [0, 0]
    for token, at in zip(got["tokens"][1:], got["text_offset"][1:]):
        assert got["text"][at:at + len(token)] == token
    assert got == completion(client, body, not stream)
