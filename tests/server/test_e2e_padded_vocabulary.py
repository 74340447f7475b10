"""A checkpoint whose vocab_size is padded past its tokenizer (4,224 rows, 4,096 tokens), served by a real
`linserve serve`: its padded rows made to win every argmax and most draws, so a padded id that reached any form of
sampling would show. Greedy text is the model's over the tokenizer's ids; seeded draws, logprobs, speculation and a
json_schema request never see a padded id; prompts and logit_bias naming one are refused with the id."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from linserve.model.checkpoint import load_checkpoint
from tests.helpers import ServerProcess, assert_json_schema_answer
from tests.model.families.checkpoints import FAMILY_CASES
from tests.model.test_vocabulary import PADDED, TOKENS, padded_checkpoint

pytestmark = pytest.mark.slow

PROMPT = "KING.\nNow is the winter of our discontent made glorious summer"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    checkpoint = padded_checkpoint(root / "checkpoint", FAMILY_CASES["gla"])
    server = ServerProcess(checkpoint, root / "serve.log", "--num-slots", "4")
    yield checkpoint, server.base
    server.stop()


def test_both_sizes_are_reported(served):
    _, base = served
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert (card["vocab_size"], card["checkpoint_vocab_size"]) == (TOKENS, PADDED)
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert (info["vocab_size"], info["checkpoint_vocab_size"]) == (TOKENS, PADDED)


def test_greedy_text_is_the_models_over_the_tokenizers_ids(served):
    checkpoint, base = served
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.float32)  # padded: every row
    ids, out = torch.tensor([tokenizer.encode(PROMPT)]), []
    with torch.no_grad():
        logits, state = model(ids)
        assert logits[0, -1].argmax() >= TOKENS  # unmasked, the padding would be chosen
        for _ in range(16):
            token = logits[0, -1, :TOKENS].argmax()
            out.append(int(token))
            logits, state = model(token.view(1, 1), state)
    reply = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(out)


def test_seeded_draws_and_logprobs_only_see_the_tokenizers_ids(served):
    """A padded id has no token: it decodes to "" (every one of the tokenizer's ids decodes to something), so
    one drawn would show as an empty token, and several among the top 5 would collapse into one "" entry."""
    _, base = served
    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 32, "temperature": 1.5, "seed": 3, "ignore_eos": True, "logprobs": 5})
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 32 and all(logprobs["tokens"]), logprobs["tokens"]
    for top in logprobs["top_logprobs"]:  # five of the tokenizer's ids, a distribution over its vocabulary
        assert len(top) == 5 and "" not in top, top
        assert 0 < sum(2.718281828459045 ** value for value in top.values()) <= 1 + 1e-5


def test_speculation_and_a_json_schema_never_see_the_padding(served):
    _, base = served
    body = {"prompt": "the the the cat the the the cat the the the", "max_tokens": 64, "temperature": 0}
    plain = httpx.post(f"{base}/v1/completions", json={**body, "speculative": {"method": "off"}}, timeout=120)
    drafted = httpx.post(f"{base}/v1/completions", json={**body, "speculative": {"method": "ngram"}}, timeout=120)
    assert drafted.status_code == plain.status_code == 200, drafted.text
    assert drafted.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert_json_schema_answer(base)


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, 2, TOKENS + 4]}, "prompt"),
    ({"prompt": "x", "logit_bias": {str(TOKENS + 4): 5}}, "logit_bias"),
])
def test_a_padded_id_in_a_request_is_refused_with_the_id(served, body, param):
    _, base = served
    reply = httpx.post(f"{base}/v1/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and str(TOKENS + 4) in error["message"], error
    assert httpx.get(f"{base}/metrics").status_code == 200 and httpx.get(f"{base}/health").status_code == 200
