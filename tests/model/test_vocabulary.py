"""model/vocabulary.py: a vocabulary padded past the tokenizer served as the tokenizer's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from linserve.model.checkpoint import CheckpointError, load_checkpoint, load_served
from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.model.vocabulary import VocabularyError, checkpoint_vocab_size, serve_tokenizer_vocabulary

from .families.checkpoints import FAMILY_CASES, write_checkpoint

TOKENS, PADDED = 4096, 4224  # the shipped tokenizer's size; a checkpoint padded to a multiple of 128


def padded_checkpoint(directory, fields: dict, loud: bool = True):
    """An fla checkpoint with vocab_size 4224 over the shipped 4096-token tokenizer; `loud`: the padded rows of
    the head (and of a tied embedding) scaled up, so any padded id would win every argmax and most draws."""
    path = write_checkpoint(directory, {**fields, "vocab_size": PADDED})
    if loud:
        tensors = load_file(str(path / "model.safetensors"))
        for name in ("lm_head.weight", "model.embeddings.weight"):
            if name in tensors and (name == "lm_head.weight" or fields.get("tie_word_embeddings")):
                tensors[name][TOKENS:] = 20 * tensors[name][: PADDED - TOKENS]
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("fields", [FAMILY_CASES["gla"], {**FAMILY_CASES["linear_attn"], "tie_word_embeddings": True}],
                         ids=["gla", "tied linear_attn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_served_model_keeps_the_tokenizers_rows_and_their_logits(tmp_path, fields, dtype):
    path = padded_checkpoint(tmp_path / "padded", fields)
    full = load_checkpoint(path, torch.device("cpu"), dtype)
    model, tokenizer = load_served(path, torch.device("cpu"), dtype)
    assert len(tokenizer) == TOKENS and model.config.vocab_size == TOKENS and checkpoint_vocab_size(model) == PADDED
    assert model.model.embeddings.weight.shape[0] == model.lm_head.weight.shape[0] == TOKENS
    assert (model.lm_head.weight is model.model.embeddings.weight) == bool(fields.get("tie_word_embeddings"))
    ids = torch.tensor([tokenizer.encode("KING.\nNow is the winter of our discontent")])
    with torch.inference_mode():
        padded_logits, _ = full(ids)
        logits, state = model(ids)
        assert padded_logits[..., TOKENS:].amax() > padded_logits[..., :TOKENS].amax()  # (the padding would win)
        assert logits.shape[-1] == TOKENS and torch.equal(logits, padded_logits[..., :TOKENS])  # the same bits
        step_logits, _ = model(ids[:, -1:], state)
        assert step_logits.shape == (1, 1, TOKENS)


def test_the_shipped_family_cut_the_same_way(tmp_path):
    path = tmp_path / "linear_gpt"
    path.mkdir()
    for source in DEFAULT_CHECKPOINT.iterdir():
        (path / source.name).write_bytes(source.read_bytes())
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    wte = next(name for name in tensors if name.endswith("wte.weight"))
    tensors[wte] = torch.cat([tensors[wte], 20 * tensors[wte][: PADDED - TOKENS]])
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": PADDED}))
    shipped = load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"))
    model, _ = load_served(path, torch.device("cpu"))
    assert model.config.vocab_size == TOKENS and checkpoint_vocab_size(model) == PADDED
    ids = torch.arange(1, 30)[None]
    with torch.inference_mode():
        assert torch.equal(model(ids)[0], shipped(ids)[0])  # the padding cut: the shipped model exactly


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "small", {**FAMILY_CASES["gla"], "vocab_size": 4000})
    with pytest.raises(CheckpointError, match="tokenizer has 4096 tokens but the model's vocab_size is 4000"):
        load_served(path, torch.device("cpu"))
    model = load_checkpoint(path, torch.device("cpu"))
    with pytest.raises(VocabularyError, match="no rows for ids 4000..4095"):
        serve_tokenizer_vocabulary(model, TOKENS)
    assert serve_tokenizer_vocabulary(model, 4000) == 4000 and checkpoint_vocab_size(model) == 4000  # nothing cut
