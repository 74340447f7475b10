"""The checkpoint shipped inside the package: loads through transformers, generates, and is trained."""

from __future__ import annotations

import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import linserve.model  # noqa: F401  (registers linear_gpt)
from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.model.training.evaluate import bits_per_byte


def test_files_and_size():
    names = {p.name for p in DEFAULT_CHECKPOINT.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_CHECKPOINT.iterdir()) < 30 * 2**20


def test_loads_with_auto_classes_and_generates_greedy_like_own_loop():
    lm = AutoModelForCausalLM.from_pretrained(DEFAULT_CHECKPOINT, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
    assert lm.model.config.attention == "linear"
    ids = tokenizer("ROMEO.\n", return_tensors="pt").input_ids
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=20, do_sample=False)
        logits, state = lm.model(ids)
        own = []
        for _ in range(out.shape[1] - ids.shape[1]):
            token = logits[:, -1].argmax(-1, keepdim=True)
            own.append(int(token))
            logits, state = lm.model(token, state)
    assert out[0, ids.shape[1]:].tolist() == own


def test_held_out_bits_per_byte_is_far_below_chance(corpus):
    lm = AutoModelForCausalLM.from_pretrained(DEFAULT_CHECKPOINT, dtype=torch.float32).eval()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    works = {"macbeth": corpus.validation["macbeth"][:20_000]}
    result = bits_per_byte(lm.model, tokenizer, works)
    assert result.bits_per_byte < 2.6  # an untrained model scores ~4.1 (ln 4096 / ln 2 / 2.9 bytes per token)


def test_cli_generate_streams_from_the_default_checkpoint():
    result = subprocess.run([sys.executable, "-m", "linserve.server.cli", "generate", "ROMEO:", "--max-tokens", "30",
                             "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) > 40
    assert "random-weight" not in result.stderr


def test_the_docs_state_size_is_what_linserve_info_prints():
    """docs/model-and-training.md names the shipped model's state bytes: the number `linserve info` prints."""
    from pathlib import Path

    from linserve.model.loading import load_model

    state_bytes = load_model(DEFAULT_CHECKPOINT, torch.device("cpu")).model.state_bytes()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "model-and-training.md").read_text()
    shipped = docs.split("The shipped model (", 1)[1].split("linserve info", 1)[0]
    assert f"holds {state_bytes:,} bytes per session" in shipped
