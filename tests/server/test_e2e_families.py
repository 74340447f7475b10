"""An fla checkpoint of each family served over HTTP by a real `linserve serve`: the same greedy text as
the family's model run directly; a session turn, a fork, an export/import and a rewind that agree; speculative
decoding with the text of plain decoding; a `json_schema` request; (gla) the compiled decode program."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from linserve.model.checkpoint import load_checkpoint
from tests.helpers import ServerProcess, assert_json_schema_answer, metric
from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint

pytestmark = pytest.mark.slow

PROMPT = "KING.\nNow is the winter of our discontent made glorious summer"
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_checkpoint(root / "checkpoint", FAMILY_CASES[request.param])
    # drafts verified whenever found: whether verifying pays is timed on this machine, and the test needs it run
    server = ServerProcess(checkpoint, root / "serve.log", "--num-slots", "8", "--speculative", "ngram",
                           env={"LINSERVE_SPECULATIVE_ALWAYS": "true"})
    yield request.param, checkpoint, server.base
    server.stop()


def direct_greedy(checkpoint, text: str, n: int) -> str:
    """The family's model run directly (fp32, as the suite serves), greedy, decoded by the checkpoint's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
    ids = torch.tensor([tokenizer.encode(text)])
    out = []
    with torch.no_grad():
        logits, state = model(ids)
        for _ in range(n):
            token = logits[0, -1].argmax()
            out.append(int(token))
            logits, state = model(token.view(1, 1), state)
    return tokenizer.decode(out)


def test_served_text_is_the_family_models_own(served):
    family, checkpoint, base = served
    models = httpx.get(f"{base}/v1/models").json()["data"]
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
    assert len(models) == 1 and models[0]["root"] == str(checkpoint)
    assert models[0]["model_type"] == FAMILY_CASES[family]["model_type"]
    assert models[0]["state_bytes"] == model.state_bytes() == model.config.state_bytes()
    reply = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, **GREEDY,
                                                       "speculative": {"method": "off"}}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == direct_greedy(checkpoint, PROMPT, GREEDY["max_tokens"])


def test_sessions_fork_export_import_and_rewind_agree(served):
    _, _, base = served
    with httpx.Client(base_url=base, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]
        first = http.post(f"/v1/sessions/{sid}/completions", json={"prompt": " and", **GREEDY})
        assert first.status_code == 200, first.text
        fork = http.post(f"/v1/sessions/{sid}/fork").json()["id"]
        imported = http.post("/v1/sessions/import", content=http.get(f"/v1/sessions/{sid}/state").content).json()["id"]
        texts = {s: http.post(f"/v1/sessions/{s}/completions", json={"prompt": " our", **GREEDY}).json()
                 ["choices"][0]["text"] for s in (sid, fork, imported)}
        assert len(set(texts.values())) == 1, texts
        turns = http.get(f"/v1/sessions/{sid}/turns").json()
        kept = [t["turn"] for t in turns if t["rewindable"] and t["turn"] >= 1]
        rewound = http.post(f"/v1/sessions/{sid}/rewind", json={"turn": kept[-2]})
        assert rewound.status_code == 200, rewound.text
        again = http.post(f"/v1/sessions/{sid}/completions", json={"prompt": " our", **GREEDY}).json()
        assert again["choices"][0]["text"] == texts[sid]


def test_speculative_decoding_gives_plain_decodings_text(served):
    """A random model's greedy text falls into a loop within 160 tokens, which prompt lookup then drafts."""
    _, _, base = served
    body = {"prompt": "the the the cat the the the cat the the the", "max_tokens": 160, "temperature": 0}
    plain = httpx.post(f"{base}/v1/completions", json={**body, "speculative": {"method": "off"}}, timeout=120)
    before = metric(base, "linserve_spec_draft_tokens_total")
    fast = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert fast.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert metric(base, "linserve_spec_draft_tokens_total") > before  # verification ran from this state


def test_a_json_schema_request_answers_valid_json(served):
    assert_json_schema_answer(served[2])


@pytest.mark.timeout(900)  # (the compile's own deadline below, 600 s, governs: a busy host compiles slower)
@pytest.mark.parametrize("family", ["gla", "hybrid"])  # hybrid: a Gated DeltaNet layer and a window layer
def test_the_compiled_decode_program_streams_the_same_text(tmp_path, compile_cache, family):
    checkpoint = write_checkpoint(tmp_path / family, FAMILY_CASES[family])
    server = ServerProcess(checkpoint, tmp_path / "serve.log", "--num-slots", "1", "--compile", "on",
                           "--compile-cache-dir", compile_cache, "--no-compile-autotune")
    try:
        deadline = 600
        while deadline > 0 and httpx.get(f"{server.base}/version").json()["decode_step"]["status"] != "compiled":
            time.sleep(2)
            deadline -= 2
        assert httpx.get(f"{server.base}/version").json()["decode_step"]["status"] == "compiled"
        reply = httpx.post(f"{server.base}/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
        assert reply.json()["choices"][0]["text"] == direct_greedy(checkpoint, PROMPT, GREEDY["max_tokens"])
    finally:
        server.stop()
