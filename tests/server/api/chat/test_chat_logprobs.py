"""Chat logprobs cover exactly the returned content, as completions' do (common/generation.ChoiceLogprobs): a stop
string's own tokens are in neither the text nor the logprobs, streamed or not."""

from __future__ import annotations

import json

import pytest

ASK = {"messages": [{"role": "user", "content": "But soft, what light through yonder window breaks?"}],
       "logprobs": True, "top_logprobs": 1, "max_tokens": 16, "temperature": 1.0, "seed": 7, "ignore_eos": True}


def chat(client, body: dict, stream: bool) -> tuple[str, list[str]]:
    """The choice's content and its logprobs' tokens, joined across chunks when streamed."""
    if not stream:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"], [entry["token"] for entry in choice["logprobs"]["content"]]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = [event["choices"][0] for event in events if event["choices"]]
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    tokens = [entry["token"] for choice in choices if choice.get("logprobs") for entry in choice["logprobs"]["content"]]
    return content, tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_strings_tokens_are_not_in_the_chat_logprobs(client, stream):
    text, tokens = chat(client, ASK, stream)
    # two whole tokens whose text first occurs where they stand: a stop string made of them cuts there
    k = next(k for k in range(1, len(tokens) - 1) if len(tokens[k] + tokens[k + 1]) > 1
             and text.find(tokens[k] + tokens[k + 1]) == len("".join(tokens[:k])))
    got_text, got_tokens = chat(client, {**ASK, "stop": [tokens[k] + tokens[k + 1]]}, stream)
    assert got_text == "".join(tokens[:k]) and got_tokens == tokens[:k]
