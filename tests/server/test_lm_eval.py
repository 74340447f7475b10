"""lm-evaluation-harness, as users run it, against a real `linserve serve` of the shipped model: its
`local-completions` model (prompt token ids, echo + logprobs, its remote tokenizer over /tokenizer_info and
/tokenize) reports the bits per byte and the multiple-choice accuracy that the model gives offline."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from linserve.model.loading import DEFAULT_CHECKPOINT, load_model
from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"  # what docs/evaluation.md runs


def passages(corpus, count: int = 20, size: int = 400) -> list[str]:
    """`count` passages of about `size` characters from the held-out plays, cut at line ends."""
    text = "\n".join(corpus.validation.values())
    out, at = [], 0
    while len(out) < count:
        end = text.index("\n", at + size)
        out.append(text[at:end].strip())
        at = end + 5_000
    return out


def choice_docs(texts: list[str]) -> list[dict]:
    """Each passage's first line, then its true next line among three with the same words out of order (the
    same length and tokens, so only the model's sense of English tells them apart)."""
    docs = []
    for i, text in enumerate(texts):
        lines = [line.strip() for line in text.splitlines() if len(line.split()) >= 4]
        words = lines[1].split()
        choices = [lines[1], " ".join(words[::-1]), " ".join(sorted(words)), " ".join(words[1:] + words[:1])]
        label = i % 4  # the true one at varying places
        choices[0], choices[label] = choices[label], choices[0]
        docs.append({"context": lines[0], "choices": choices, "label": label})
    return docs


@pytest.fixture(scope="module")
def offline():
    """Log-probability of `continuation` ids after `context` ids, by one forward of the shipped model."""
    model = load_model(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.float32).model

    def loglik(context: list[int], continuation: list[int]) -> float:
        ids = context + continuation
        with torch.inference_mode():
            logits, _ = model(torch.tensor([ids]))  # (1, T, V)
        logp = torch.log_softmax(logits[0].double(), dim=-1)  # (T, V)
        targets = torch.tensor(continuation)[:, None]
        return float(logp[len(context) - 1 : len(ids) - 1].gather(1, targets).sum())

    return loglik


def test_the_shipped_task_data_is_what_the_corpus_gives(corpus):
    texts = passages(corpus)
    assert [json.loads(line)["text"] for line in (TASKS / "passages.jsonl").read_text().splitlines()] == texts
    assert [json.loads(line) for line in (TASKS / "choices.jsonl").read_text().splitlines()] == choice_docs(texts)


def test_lm_eval_local_completions_reports_the_offline_numbers(offline, tmp_path):
    """The recipe's tasks (configs/lm_eval), run from the repository root as docs/evaluation.md says."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))
    texts = [json.loads(line)["text"] for line in (TASKS / "passages.jsonl").read_text().splitlines()]
    docs = [json.loads(line) for line in (TASKS / "choices.jsonl").read_text().splitlines()]

    # offline: a passage is scored after end-of-text; a choice is " " + its text after the context, its ids
    # the tail of encode(context + continuation) beyond encode(context) (how lm-eval splits a pair)
    encode = tokenizer.encode
    eot = tokenizer.eos_token_id
    total = sum(offline([eot], encode(t)) for t in texts)
    want_bpb = -total / sum(len(t.encode()) for t in texts) / math.log(2)
    correct = 0
    for doc in docs:
        context = encode(doc["context"])
        scores = [offline(context, encode(doc["context"] + " " + c)[len(context):]) for c in doc["choices"]]
        correct += max(range(4), key=scores.__getitem__) == doc["label"]
    want_acc = correct / len(docs)

    server = ServerProcess(DEFAULT_CHECKPOINT, tmp_path / "serve.log", "--num-slots", "8")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model=linserve-shakespeare,base_url={server.base}/v1/completions,num_concurrent=2,max_retries=1",
             "--include_path", "configs/lm_eval", "--tasks", "linserve_passages,linserve_choices",
             "--output_path", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=900, cwd=TASKS.parents[1],
        )
    finally:
        server.stop()
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "Using remote tokenizer backend" in result.stderr  # /tokenizer_info + /tokenize: no checkpoint needed
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    got_bpb = results["linserve_passages"]["bits_per_byte,none"]
    assert got_bpb > 1.0 and abs(got_bpb - want_bpb) <= 0.005 * want_bpb, (got_bpb, want_bpb)
    assert results["linserve_choices"]["acc,none"] == want_acc, (results["linserve_choices"], want_acc)
    assert want_acc >= 0.5  # the model, not chance (0.25), picks the true lines
