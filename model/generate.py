"""Single-sequence generation, cut into named phases: prefill → decode_one_token → sample, repeated.

This is the plain reference loop (CLI, HF comparisons); the server's engine batches many sequences.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .families.linear_gpt import LinearGPT
from .state import ModelState


@torch.no_grad()
def prefill(model: LinearGPT, ids: torch.Tensor, state: ModelState | None = None) -> tuple[torch.Tensor, ModelState]:
    """Consume a prompt (B, T) with the chunked form; return the last position's logits (B, V) and state."""
    logits, state = model(ids, state)  # (B, T, V)
    return logits[:, -1], state


@torch.no_grad()
def decode_one_token(model: LinearGPT, token: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]:
    """One recurrent step: token (B,) → logits (B, V) and the next state."""
    logits, state = model(token[:, None], state)  # (B, 1, V)
    return logits[:, 0], state


def sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits (B, V) → token ids (B,). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B,)


def generate_tokens(
    model: LinearGPT,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    eos_id: int | None = None,
    seed: int = 0,
) -> Iterator[int]:
    """Yield new token ids one by one; stops at EOS (not yielded) or after max_new_tokens."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    device = next(model.parameters()).device  # any family (the model interface)
    generator = torch.Generator(device=device).manual_seed(seed)
    logits, state = prefill(model, torch.tensor([prompt_ids], device=device))
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_k, generator)  # (1,)
        if eos_id is not None and int(token) == eos_id:
            return
        yield int(token)
        logits, state = decode_one_token(model, token, state)
