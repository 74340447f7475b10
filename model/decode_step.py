"""The decode step as a function of flat tensors: the form `torch.compile` and CUDA graphs capture.

`LinearGPT.forward` takes and returns `ModelState` dataclasses; the compiler wants plain positional
tensors (and cannot trace `dataclasses.fields`). `flat_decode_step(model)` returns

    step(tokens, *state) -> (logits, *new_state)

with tokens (B, 1) int64, `state` the model's state tensors in `state_names(model)` order (per layer
S (B, H, dk, dv), z (B, H, dk) and, with a convolution, its window (B, W, C); fp32 always) and logits
(B, V) fp32. It runs the same modules as `forward`, so it is the same function: only the packaging differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .families.linear_gpt import LinearGPT

FlatStep = Callable[..., tuple[torch.Tensor, ...]]


def state_names(model: LinearGPT) -> list[str]:
    """The flat order of a linear model's state tensors (that of its state's `tensors()`), any family."""
    return list(model.init_state(1, "meta").tensors())


def flat_decode_step(model: LinearGPT) -> FlatStep:
    """One recurrent step of a linear-attention model over flat tensors (see the module docstring)."""
    if model.config.attention != "linear":
        raise ValueError("the flat decode step carries a fixed (S, z) state: attention must be 'linear'")
    names = state_names(model)  # outside the traced function

    def step(tokens: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, new = model(tokens, model.state_from_tensors(dict(zip(names, state))))  # (B, 1, V)
        return (logits[:, 0].float(), *new.tensors().values())  # (B, V) fp32, then the state

    return step


def flat_prefill_step(model: LinearGPT) -> FlatStep:
    """T tokens from the state before them, the state after every prefix kept and the logits at one position a
    row (the prefill program: a chunk padded on the right, read at its own end):

        step(tokens (B, T), at (B,), *state) -> (logits (B, V) fp32 at `at`, *state after every prefix (B, T, …))

    The head runs on B rows, not B · T: the bits of `flat_verify_step`'s logits there (the head is row by row);
    `at` None reads every position, as `flat_verify_step` does."""
    if model.config.attention != "linear":
        raise ValueError("keeping the state after every prefix from a fixed (S, z) state needs attention 'linear'")
    names = state_names(model)  # outside the traced function

    def step(tokens: torch.Tensor, at: torch.Tensor | None, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, prefixes = model(tokens, model.state_from_tensors(dict(zip(names, state))), prefixes=True,
                                 logits_at=at)  # (B, V), or (B, T, V) where `at` is None
        return (logits.float(), *prefixes.tensors().values())

    return step


def flat_verify_step(model: LinearGPT) -> FlatStep:
    """T tokens from the state before them, keeping the state after every prefix (speculative decoding):

        step(tokens (B, T), *state) -> (logits (B, T, V) fp32, *state after every prefix (B, T, …) each)

    in `state_names` order; the recurrence's scan over the T tokens, so one pass verifies a draft."""
    every = flat_prefill_step(model)

    def step(tokens: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return every(tokens, None, *state)  # every position's logits (B, T, V)

    return step
