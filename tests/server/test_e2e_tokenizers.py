"""A checkpoint's own tokenizer, of the sentencepiece kind fla checkpoints usually carry ("▁" for spaces,
byte fallback, <s> prepended, a chat template), served by a real `linserve serve` of a GLA checkpoint: bos
where a sequence starts and not where a session continues, exact incremental detokenisation (multi-byte
characters, leading spaces), stop strings, /tokenize, /detokenize, /tokenizer_info, the chat template, a
`json_schema` request through the grammar engine's view of this vocabulary. And a GPT-NeoX-style byte-level BPE
(the Pile's layout: nothing prepended, ChatML's added special tokens) over a padded vocabulary, with its
generation_config.json's second end-of-text id. And RWKV's world vocabulary under an RWKV-7 checkpoint, read
natively (the checkpoint's own tokenizer code is never run)."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from linserve.server.engine.detokenize import IncrementalDetokenizer
from tests.helpers import ServerProcess
from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint
from tests.model.families.neox_style import make_tokenizer as make_neox_tokenizer
from tests.model.families.sentencepiece_style import make_tokenizer
from tests.model.families.world_style import make_tokenizer as make_world_tokenizer

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


@pytest.fixture(scope="module")
def neox_served(tmp_path_factory):
    """A GPT-NeoX-style byte-level BPE (1,002 ids with ChatML's added special tokens) over a model vocabulary
    padded to 1,024, generation_config.json naming <|im_end|> as a second end-of-text; served with
    `generation_config: auto`."""
    root = tmp_path_factory.mktemp("neox")
    checkpoint = write_checkpoint(root / "checkpoint", {"model_type": "gla", "vocab_size": 1024},
                                  tokenizer=make_neox_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (checkpoint / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [0, im_end]}))
    server = ServerProcess(checkpoint, root / "serve.log", "--num-slots", "4",
                           env={"LINSERVE_GENERATION_CONFIG": "auto"})
    yield tokenizer, server.base
    server.stop()


def assert_streamed_is_whole(http: httpx.Client) -> None:
    """40 greedy tokens of TEXT's continuation: the streamed deltas join to the whole answer's text."""
    body = {"prompt": TEXT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                           if line.startswith("data: {"))
    assert streamed == whole and len(whole) > 4


def test_a_byte_level_bpe_detokenises_exactly_at_every_split(tmp_path):
    tokenizer = make_neox_tokenizer(tmp_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # a character split across tokens
    for split in range(1, len(ids)):
        stream = IncrementalDetokenizer(tokenizer, context=ids[:split])
        text = "".join(stream.add(i) for i in ids[split:])
        whole, before = tokenizer.decode(ids), tokenizer.decode(ids[:split])
        if not before.endswith("\ufffd"):  # (a prompt that ends inside a character: its text is not whole yet)
            assert text == whole[len(before):], split


def test_the_neox_layout_is_served_as_its_tokenizer_says(neox_served):
    tokenizer, base = neox_served
    with httpx.Client(base_url=base, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
        assert ids == tokenizer.encode(TEXT) and ids[0] != tokenizer.bos_token_id  # nothing prepended
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == TEXT
        info = http.get("/tokenizer_info").json()
        assert (info["vocab_size"], info["checkpoint_vocab_size"]) == (len(tokenizer), 1024) == (1002, 1024)
        assert info["eos_token"] == "<|endoftext|>" and "<|im_start|>" in info["chat_template"]
        card = http.get("/v1/models").json()["data"][0]
        assert card["generation_defaults"]["eos_token_ids"] == [0, 1001]
        rendered = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hail"}]}).json()["tokens"]
        template = tokenizer.apply_chat_template([{"role": "user", "content": "Hail"}], tokenize=False,
                                                 add_generation_prompt=True)
        assert rendered == tokenizer(template)["input_ids"] and 1000 in rendered  # <|im_start|>: one token
        assert_streamed_is_whole(http)


def test_the_chat_templates_end_token_ends_a_reply(neox_served):
    """<|im_end|> is an end-of-text by generation_config.json: pushed to be the first token, it ends the reply
    with nothing said; told to go on (ignore_eos), the reply runs to its budget."""
    _, base = neox_served
    chat = {"messages": [{"role": "user", "content": "Hail"}], "max_tokens": 6, "temperature": 0,
            "logit_bias": {"1001": 100}}
    ended = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).json()
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["choices"][0]["message"]["content"] == ""
    assert ended["usage"]["completion_tokens"] == 1
    going_on = httpx.post(f"{base}/v1/chat/completions", json={**chat, "ignore_eos": True}, timeout=60).json()
    assert going_on["choices"][0]["finish_reason"] == "length" and going_on["usage"]["completion_tokens"] == 6


@pytest.fixture(scope="module")
def world_served(tmp_path_factory):
    """An RWKV-7 checkpoint with RWKV's world vocabulary (1,023 entries + <s>: 1,024 ids)."""
    root = tmp_path_factory.mktemp("world")
    checkpoint = write_checkpoint(root / "checkpoint", {**FAMILY_CASES["rwkv7"], "vocab_size": 1024},
                                  tokenizer=make_world_tokenizer)
    server = ServerProcess(checkpoint, root / "serve.log", "--num-slots", "4")
    yield make_world_tokenizer(root / "tokenizer"), server.base
    server.stop()


def test_the_world_vocabulary_is_served_natively(world_served):
    tokenizer, base = world_served
    with httpx.Client(base_url=base, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
        assert ids == tokenizer.encode(TEXT) and ids[0] != 0  # nothing prepended
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == TEXT
        info = http.get("/tokenizer_info").json()
        assert info["vocab_size"] == 1024 and info["eos_token"] == "<s>" and info["chat_template"]
        rendered = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hail"}]}).json()["tokens"]
        assert rendered == tokenizer.encode("User: Hail\n\nAssistant:")
        assert_streamed_is_whole(http)


def test_a_json_schema_request_answers_valid_json_in_the_world_vocabulary(world_served):
    """The grammar engine reads this slow tokenizer's bytes (no Rust tokenizer to hand it)."""
    _, base = world_served
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"], "additionalProperties": False}
    reply = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "prompt": "Answer:", "max_tokens": 60, "temperature": 0.8, "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert reply.status_code == 200, reply.text
    value = json.loads(reply.json()["choices"][0]["text"])
    assert isinstance(value["n"], int) and isinstance(value["s"], str)
