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
from torch.overrides import TorchFunctionMode

from . import families
from .families import UnsupportedCheckpoint
from .vocabulary import serve_tokenizer_vocabulary

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


def load_tokenizer(path: str | Path):
    """The checkpoint's own tokenizer (`AutoTokenizer`; the tokenizer's own files say which class it is — or, for
    RWKV's world vocabulary file without a tokenizer.json, model/world_tokenizer.py, never the checkpoint's code). Its
    config.json is not read as a model config there: an fla model_type is unknown to transformers, and reading a
    linear_gpt one would import transformers' modeling code (hf_config.py) that serving never needs."""
    from transformers import AutoTokenizer, PreTrainedConfig

    from .world_tokenizer import VOCAB_FILE, WorldTokenizer

    if (Path(path) / VOCAB_FILE).is_file() and not (Path(path) / "tokenizer.json").is_file():
        # RWKV's world vocabulary: its own tokenizer class is checkpoint code (trust_remote_code); ours reads it
        return WorldTokenizer.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), config=PreTrainedConfig())


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors file(s), on the CPU; a truncated or corrupt file is a
    CheckpointError naming it."""
    from safetensors.torch import load_file

    files = weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name)))
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for every damage
            raise CheckpointError(f"{path / name} cannot be read (truncated or corrupt?): {error}") from None
    return tensors


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name → shape of every tensor in the directory's safetensors file(s), from their headers (no data read);
    a file shorter than its header says, or otherwise unreadable, is a CheckpointError naming it."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for name in weight_files(path):
        try:
            with safe_open(str(path / name), "pt") as handle:
                shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for every damage
            raise CheckpointError(f"{path / name} cannot be read (truncated or corrupt?): {error}") from None
    return shapes


def weight_files(path: Path) -> list[str]:
    if (path / WEIGHTS_INDEX).is_file():
        try:
            return sorted(set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as error:
            raise CheckpointError(f"{path / WEIGHTS_INDEX} is not a safetensors index: {error}") from None
    if (path / WEIGHTS).is_file():
        return [WEIGHTS]
    raise CheckpointError(f"{path} has no weights ({WEIGHTS} or {WEIGHTS_INDEX})")


def check_weights(model: nn.Module, shapes: dict[str, tuple[int, ...]], path: Path, model_type: str) -> None:
    """The checkpoint's tensors against the model's, by name and shape (a tied head may be absent)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(shapes) - tied)
    unexpected = sorted(set(shapes) - set(expected))
    misshapen = sorted(f"{name} {shapes[name]} (the config makes {expected[name]})"
                       for name in set(expected) & set(shapes) if shapes[name] != expected[name])
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            problems.append(f"{len(names)} {label}: {shown}")
    if problems:
        raise CheckpointError(f"{path}: the weights do not match config.json (model_type {model_type}): "
                              + "; ".join(problems))


class SavedLinearGPT(nn.Module):
    """A LinearGPT in the layout its checkpoints are saved in — LinearGPTForCausalLM's, the model under `model.` —
    without transformers' model class (the server never imports transformers' modeling code)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model  # LinearGPT

    @property
    def config(self):
        return self.model.config


class _NoDrawsOnMeta(TorchFunctionMode):
    """Random initialisation of meta tensors skipped (they hold no values to draw): `normal_` has no meta kernel,
    and its Python reference imports torch._dynamo — over a second of every start, for nothing. (A torch function
    mode is this thread's alone.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.normal_, torch.nn.init.normal_):
            tensor = args[0] if args else kwargs.get("tensor")
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


def skeleton(raw: dict) -> nn.Module:
    """The module a config.json describes, on the meta device (no memory, no init): a linear_gpt's LinearGPT in its
    saved layout, an fla family's FlaCausalLM. UnsupportedCheckpoint for what is not served."""
    with torch.device("meta"), _NoDrawsOnMeta():
        if raw.get("model_type") == families.LINEAR_GPT:
            try:
                return SavedLinearGPT(families.build(raw))
            except (TypeError, ValueError) as error:
                raise CheckpointError(f"config.json does not describe a linear_gpt model: {error}") from None
        try:
            return families.build(raw)
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"config.json lacks or mistypes a field of {raw.get('model_type')}: "
                                  f"{error}") from None


def validate(path: str | Path, tokenizer=None) -> dict:
    """Everything `load_checkpoint` would refuse, from config.json and the weights' headers alone (cheap:
    `serve` calls it before it binds its port): raises CheckpointError / UnsupportedCheckpoint. With a
    tokenizer, its size too. Returns the config's fields."""
    return _validated(Path(path), tokenizer)[0]


def _validated(path: Path, tokenizer=None) -> tuple[dict, nn.Module]:
    """`validate`'s checks; the config's fields and the skeleton they were checked against."""
    raw = read_config(path)
    model = skeleton(raw)
    check_weights(model, weight_shapes(path), path, raw.get("model_type"))
    if tokenizer is not None:
        check_tokenizer(tokenizer, model.config.vocab_size, path)
    return raw, model


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The served model of a checkpoint directory, in eval mode, on `device`: parameters in `dtype`, buffers as
    saved (a head's decay stays fp32) — what `from_pretrained(dtype=…)` makes of it, for every family."""
    path = Path(path)
    raw, model = _validated(path)
    model.load_state_dict(read_weights(path), strict=False, assign=True)  # (names and shapes checked above)
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.body.embeddings.weight
    for parameter in model.parameters():  # each once: a tied head stays tied
        parameter.data = parameter.data.to(device=device, dtype=dtype)
    for buffer in model.buffers():
        buffer.data = buffer.data.to(device=device)
    left = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if left:  # (a tensor the skeleton has that nothing loaded: check_weights allows only a tied head to be absent)
        raise CheckpointError(f"{path}: nothing in the weights for {', '.join(left[:5])}")
    return (model.model if isinstance(model, SavedLinearGPT) else model).eval()


def check_tokenizer(tokenizer, vocab_size: int, path: Path) -> None:
    """Every id the tokenizer makes must be embeddable: its size at most the model's vocab_size. A vocabulary
    padded past the tokenizer is served as the tokenizer's (vocabulary.serve_tokenizer_vocabulary)."""
    size = len(tokenizer)
    if size > vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {size} tokens but the model's vocab_size is {vocab_size} "
                              f"(config.json): the model has no rows for ids {vocab_size}..{size - 1}")


def load_served(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) as a server serves them: `load_checkpoint`, the checkpoint's tokenizer, checked against
    the model, and a vocabulary padded past the tokenizer cut to it — every form (serve, compile, generate) the
    same model, so the compile cache and session snapshots name the same weights."""
    model = load_checkpoint(path, device, dtype)
    tokenizer = load_tokenizer(path)
    check_tokenizer(tokenizer, model.config.vocab_size, Path(path))
    serve_tokenizer_vocabulary(model, len(tokenizer))
    return model, tokenizer


__all__ = ["CheckpointError", "UnsupportedCheckpoint", "load_checkpoint", "load_served", "check_tokenizer",
           "read_config"]
