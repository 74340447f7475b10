"""Loading a checkpoint directory to serve — strictly: a directory that is not a complete, consistent
checkpoint of a served family is refused with one error naming what is wrong, never served with random
weights.

    config.json       model_type → the family (families/); every field checked by the family
    model.safetensors (or model.safetensors.index.json + shards): every tensor the model has, by name and
                      shape — none missing, none left over, none misshapen, none unreadable
    the tokenizer     (AutoTokenizer from the directory): exactly the model's vocabulary
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from . import families
from .families import UnsupportedCheckpoint

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A directory that cannot be served as a checkpoint (the message says why)."""


def read_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory (no config.json)")
    try:
        raw = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config} must hold a JSON object")
    return raw


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors file(s), on the CPU; a truncated or corrupt file is a
    CheckpointError naming it."""
    from safetensors.torch import load_file

    if (path / WEIGHTS_INDEX).is_file():
        index = json.loads((path / WEIGHTS_INDEX).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
    elif (path / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise CheckpointError(f"{path} has no weights ({WEIGHTS} or {WEIGHTS_INDEX})")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name)))
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for every damage
            raise CheckpointError(f"{path / name} cannot be read (truncated or corrupt?): {error}") from None
    return tensors


def check_weights(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path, model_type: str) -> None:
    """The checkpoint's tensors against the model's, by name and shape (a tied head may be absent)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(tensors) - tied)
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = sorted(f"{name} {tuple(tensors[name].shape)} (the config makes {expected[name]})"
                       for name in set(expected) & set(tensors) if tuple(tensors[name].shape) != expected[name])
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            problems.append(f"{len(names)} {label}: {shown}")
    if problems:
        raise CheckpointError(f"{path}: the weights do not match config.json (model_type {model_type}): "
                              + "; ".join(problems))


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The served model of a checkpoint directory, in eval mode, parameters in `dtype` (buffers as saved)."""
    path = Path(path)
    raw = read_config(path)
    if raw.get("model_type") == families.LINEAR_GPT:
        from .loading import load_model

        return load_model(path, device, dtype).model  # checked by load_model (the HF class, strictly)
    with torch.device("meta"):
        model = families.build(raw)  # raises UnsupportedCheckpoint for a type or option not served
    tensors = read_weights(path)
    check_weights(model, tensors, path, raw["model_type"])
    model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embeddings.weight
    for parameter in model.parameters():
        parameter.data = parameter.data.to(device=device, dtype=dtype)
    return model.eval()


def check_tokenizer(tokenizer, vocab_size: int, path: Path) -> None:
    """The tokenizer must be the model's vocabulary: every id it makes embeddable, every id the model can
    emit decodable."""
    size = len(tokenizer)
    if size != vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {size} tokens but the model's vocab_size is {vocab_size} "
                              "(config.json): they must be the same vocabulary")


__all__ = ["CheckpointError", "UnsupportedCheckpoint", "load_checkpoint", "check_tokenizer", "read_config"]
