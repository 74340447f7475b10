"""Hugging Face integration: Auto classes, safetensors round trip, generate() carrying the state."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import linserve.model  # noqa: F401  (registers linear_gpt)
from linserve.model import LinearGPTConfig, LinearGPTForCausalLM, ModelConfig
from linserve.model.state import ModelState

CONFIG = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, chunk_size=4,
    feature_map="favor", favor_features=12, decay=True, conv_kernel=3, seed=5,
)


def build(config: ModelConfig = CONFIG) -> LinearGPTForCausalLM:
    torch.manual_seed(0)
    return LinearGPTForCausalLM(LinearGPTConfig.from_model_config(config, eos_token_id=0)).eval()


def own_greedy(lm: LinearGPTForCausalLM, ids: torch.Tensor, steps: int) -> torch.Tensor:
    logits, state = lm.model(ids)
    out = []
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(token)
        logits, state = lm.model(token, state)
    return torch.cat(out, dim=1)


def test_config_round_trips_through_hf_config():
    hf_config = LinearGPTConfig.from_model_config(CONFIG)
    assert hf_config.model_type == "linear_gpt"
    assert hf_config.to_model_config() == CONFIG


@torch.no_grad()
def test_save_and_load_give_identical_logits(tmp_path):
    lm = build()
    lm.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "linear_gpt"
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LinearGPTConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, LinearGPTForCausalLM)
    ids = torch.randint(1, 61, (2, 13))
    assert torch.equal(lm(ids).logits, loaded(ids).logits)
    for (name, a), (_, b) in zip(lm.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


@torch.no_grad()
def test_favor_projection_is_loaded_not_redrawn(tmp_path):
    lm = build()
    lm.save_pretrained(tmp_path)
    # a different seed in config.json would draw a different projection; loading must ignore it
    config = json.loads((tmp_path / "config.json").read_text())
    config["seed"] = 999
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    original = lm.model.blocks[0].attn.feature_map.projection
    assert torch.equal(loaded.model.blocks[0].attn.feature_map.projection, original)
    redrawn = LinearGPTForCausalLM(loaded.config).model.blocks[0].attn.feature_map.projection
    assert not torch.equal(redrawn, original)


def generate_counting_forwards(lm: LinearGPTForCausalLM, ids: torch.Tensor, steps: int, **kwargs):
    """Greedy `generate()` with the final state returned; also the length of every forward's input."""
    calls = []
    hook = lm.model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    try:
        out = lm.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          return_dict_in_generate=True, **kwargs)
    finally:
        hook.remove()
    return out, calls


def carried_state(out) -> ModelState:
    """generate()'s cache: `cache` from transformers 5.24, `past_key_values` before (the same object)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


@torch.no_grad()
def test_generate_greedy_equals_own_loop_and_carries_state():
    lm = build()
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    out, calls = generate_counting_forwards(lm, ids, 12, attention_mask=torch.ones_like(ids))
    assert torch.equal(out.sequences[:, 9:], own_greedy(lm, ids, 12))
    assert calls == [9] + [1] * 11  # the prefix once, then one token per step: never re-run
    # the cache generate() ends with is the state after everything but the last token (not yet fed)
    _, want = lm.model(out.sequences[:, :-1])
    got = carried_state(out)
    assert isinstance(got, ModelState) and got.tensors().keys() == want.tensors().keys()
    for name, tensor in want.tensors().items():
        torch.testing.assert_close(got.tensors()[name], tensor, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_generate_continues_from_a_returned_state_without_rereading_the_history():
    lm = build()
    ids = torch.randint(1, 61, (1, 7), generator=torch.Generator().manual_seed(2))
    whole, _ = generate_counting_forwards(lm, ids, 10)
    first, _ = generate_counting_forwards(lm, ids, 4)
    rest, calls = generate_counting_forwards(lm, first.sequences, 6, state=carried_state(first))
    assert calls == [1] * 6  # only the newest token each step: the 11-token history is in the state
    assert torch.equal(rest.sequences, whole.sequences)


@torch.no_grad()
def test_generate_sampling_is_seeded():
    lm = build()
    ids = torch.randint(1, 61, (1, 5))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(lm.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, min_new_tokens=10))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (1, 15)


@torch.no_grad()
def test_batched_generate_with_left_padding_matches_single():
    lm = build()
    short = torch.randint(1, 61, (1, 4))
    long = torch.randint(1, 61, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 5), torch.ones(1, 4)], 1), torch.ones(1, 9)]).long()
    out = lm.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0)
    assert torch.equal(out[0:1, 9:], own_greedy(lm, short, 6))
    assert torch.equal(out[1:2, 9:], own_greedy(lm, long, 6))


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@torch.no_grad()
def test_labels_give_a_language_modelling_loss(attention):
    lm = build(ModelConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, attention=attention))
    ids = torch.randint(0, 61, (2, 10))
    loss = lm(ids, labels=ids).loss
    assert loss.ndim == 0 and 3.0 < loss.item() < 5.0  # ≈ ln(61) = 4.11 at initialisation
