"""Checkpoint directories of the fla families made without fla (for tests that need a served family, not
fla's reference): the family's own module, seeded and perturbed, saved as fla's `save_pretrained` lays it out
(config.json with fla's field names, model.safetensors) with the shipped tokenizer beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from linserve.model import families
from linserve.model.loading import DEFAULT_CHECKPOINT

BASE = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=4096)
FAMILY_CASES = {  # one checkpoint per family, with its state-shaping options on
    "linear_attn": {"model_type": "linear_attn", "feature_map": "elu", "norm_feature_map": True, "num_kv_heads": 2},
    "gla": {"model_type": "gla", "use_short_conv": True, "num_kv_heads": 2},
    "retnet": {"model_type": "retnet"},
    "delta_net": {"model_type": "delta_net", "use_gate": True},
    "gated_deltanet": {"model_type": "gated_deltanet", "head_dim": 16, "num_heads": 2, "num_v_heads": 4},
    "hybrid": {"model_type": "gated_deltanet", "head_dim": 16, "attn": {"layers": [1], "num_heads": 4,
                                                                       "num_kv_heads": 2, "window_size": 8}},
    "mamba2": {"model_type": "mamba2", "head_dim": 16, "num_heads": 8, "state_size": 8, "n_groups": 2},
    "rwkv7": {"model_type": "rwkv7", "head_dim": 16, "value_dim": 128, "decay_low_rank_dim": 8,
              "gate_low_rank_dim": 16, "a_low_rank_dim": 8, "v_low_rank_dim": 8},
}


def write_checkpoint(directory: Path, fields: dict, seed: int = 0, tokenizer=None) -> Path:
    """`tokenizer(directory)` writes the tokenizer's files (default: the shipped tokenizer's are copied)."""
    raw = {**BASE, **fields}
    torch.manual_seed(seed)
    model = families.build(raw)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn_like(parameter)
            parameter.copy_(noise * 0.3 if parameter.dim() > 1 else 1 + 0.1 * noise)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()
               if not (name == "lm_head.weight" and raw.get("tie_word_embeddings"))}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    if tokenizer is not None:
        tokenizer(directory)
        return directory
    for source in DEFAULT_CHECKPOINT.iterdir():
        if source.name not in ("config.json", "model.safetensors"):
            shutil.copy(source, directory / source.name)
    return directory
