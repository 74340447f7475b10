"""What a served model is, as the server reads it: typed Protocols, so the engine, the state pool, the compiler
child, sessions and /v1/models depend on this and on no family (docs/models.md, "The model interface").

A family (`model/families/<model_type>.py`, or the shipped `linear_gpt`) satisfies `ServedModel` structurally:
nothing inherits from these. `model_type` and `fixed_state` are the one place that says which family a config is
and which kind of state it keeps (a fixed-size recurrent state, or the softmax baseline's growing KV cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .families import LINEAR_GPT  # noqa: F401 - the shipped family's model_type, re-exported for the server


class ServedState(Protocol):
    """A batch's state: named tensors (B, …) — fixed-size per layer and fp32 for a linear model."""

    def tensors(self) -> dict[str, Tensor]: ...


class ServedConfig(Protocol):
    model_type: str  # the family (config.json's `model_type`): model/families/<model_type>.py
    attention: str  # "linear": a fixed-size state; "softmax": the baseline's KV cache
    n_layers: int
    vocab_size: int  # the served vocabulary (vocabulary.py: a padded checkpoint's cut to its tokenizer)

    def to_dict(self) -> dict: ...  # the compile cache's and a snapshot's key, and the compiler child's rebuild

    def state_bytes(self, context_len: int = 0) -> int: ...


@runtime_checkable
class ServedModel(Protocol):
    """A family's model as the server uses it: its config, the state's constructors and the one function of
    both forms — `forward(ids (B, T), state) → (logits (B, T, V), state after)`, chunkwise for a prompt and the
    recurrence for a token (one function: invariant 1), `prefixes=True` keeping the state after every prefix
    (speculative verification), `logits_at` (B,) the logits at each row's one position only, (B, V) (the
    prefill program: a chunk's last token)."""

    config: ServedConfig

    def init_state(self, batch: int, device: torch.device | str | None = None) -> ServedState: ...

    def state_from_tensors(self, tensors: dict[str, Tensor]) -> ServedState: ...

    def state_bytes(self, context_len: int = 0) -> int: ...

    def num_parameters(self) -> int: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def __call__(self, ids: Tensor, state: ServedState | None = None, key_mask: Tensor | None = None,
                 prefixes: bool = False, logits_at: Tensor | None = None) -> tuple[Tensor, ServedState]: ...


def pooled_state_names(model: ServedModel) -> list[str]:
    """The state tensors a family's decode step reads from the pool in place and returns as pending updates
    (model/pooled_state.py; a family's optional `pooled_state_names()`): [] when it has none."""
    names = getattr(model, "pooled_state_names", None)
    return list(names()) if names is not None else []


def folded_state_names(model: ServedModel) -> list[str]:
    """Among `pooled_state_names`, those whose commit is folded into the next step's read (a family's optional
    `folded_state_names()`; model/pooled_state.py): [] when it has none."""
    names = getattr(model, "folded_state_names", None)
    return list(names()) if names is not None else []


def model_type(config: ServedConfig) -> str:
    """The family a config is (config.json's `model_type`)."""
    return config.model_type


def fixed_state(model_or_config: ServedModel | ServedConfig) -> bool:
    """Whether the model keeps a fixed-size state (every family but the softmax baseline): the state pool,
    sessions, speculation and compiled programs need one."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.attention == "linear"
