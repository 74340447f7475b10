"""A checkpoint's own tokenizer, of the sentencepiece kind fla checkpoints usually carry ("▁" for spaces,
byte fallback, <s> prepended, a chat template), served by a real `linserve serve` of a GLA checkpoint: bos
where a sequence starts and not where a session continues, exact incremental detokenisation (multi-byte
characters, leading spaces), stop strings, /tokenize, /detokenize, /tokenizer_info, the chat template, a
`json_schema` request through the grammar engine's view of this vocabulary."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from linserve.server.engine.detokenize import IncrementalDetokenizer
from tests.helpers import ServerProcess
from tests.model.families.checkpoints import write_checkpoint
from tests.model.families.sentencepiece_style import make_tokenizer

pytestmark = pytest.mark.slow

TEXT = "Now is the winter — café, naïve 日本語 🙂 of our discontent"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentencepiece")
    checkpoint = write_checkpoint(root / "checkpoint", {"model_type": "gla", "vocab_size": 1024},
                                  tokenizer=make_tokenizer)
    server = ServerProcess(checkpoint, root / "serve.log", "--num-slots", "4")
    yield AutoTokenizer.from_pretrained(str(checkpoint)), server.base
    server.stop()


def test_incremental_detokenisation_is_exact_for_bytes_and_leading_spaces(tmp_path):
    tokenizer = make_tokenizer(tmp_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback is exercised
    splits = [s for s in range(1, len(ids)) if not tokenizer.decode(ids[:s]).endswith("\ufffd")]  # a whole prompt
    assert len(splits) > len(ids) // 2
    for split in splits:  # every later character, bytes and "▁" pieces alike, arrives exactly once and whole
        stream = IncrementalDetokenizer(tokenizer, context=ids[:split])
        text = "".join(stream.add(i) for i in ids[split:])
        assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:split])):], split


def test_bos_starts_a_sequence_and_never_a_continuation(served):
    tokenizer, base = served
    with httpx.Client(base_url=base, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
        assert ids == tokenizer(TEXT)["input_ids"] and ids[0] == tokenizer.bos_token_id
        assert http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"] == ids[1:]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
        info = http.get("/tokenizer_info").json()
        assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>" and info["chat_template"]
        created = http.post("/v1/sessions", json={"prompt": TEXT}).json()
        assert created["tokens"] == len(ids)  # bos once, at the start
        sid = created["id"]
        turn = http.post(f"/v1/sessions/{sid}/completions", json={"prompt": " and", "max_tokens": 1}).json()
        assert turn["usage"]["prompt_tokens"] == len(tokenizer.encode(" and", add_special_tokens=False))
        rendered = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hail"}]}).json()["tokens"]
        template = tokenizer.apply_chat_template([{"role": "user", "content": "Hail"}], tokenize=False,
                                                 add_generation_prompt=True)
        assert rendered == tokenizer(template)["input_ids"]


def test_streamed_text_is_the_whole_text_and_stops_where_asked(served):
    _, base = served
    body = {"prompt": TEXT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                           if line.startswith("data: {"))
    assert streamed == whole and len(whole) > 4
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = httpx.post(f"{base}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == whole[:whole.index(stop)]


def test_a_json_schema_request_answers_valid_json_in_this_vocabulary(served):
    _, base = served
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Name?"}], "max_tokens": 60, "temperature": 0.7, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert reply.status_code == 200, reply.text
    assert isinstance(json.loads(reply.json()["choices"][0]["message"]["content"])["name"], str)
