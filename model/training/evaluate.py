"""Held-out bits per byte: tokenizer-independent, over whole works, state carried chunk by chunk."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..families.linear_gpt import LinearGPT
from .tokenizer import EOT_TOKEN


@dataclass(frozen=True)
class EvalResult:
    bits_per_byte: float
    nats_per_token: float
    tokens: int
    bytes: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@torch.no_grad()
def work_nll(model: LinearGPT, ids: torch.Tensor, block: int, window: int | None, batch: int = 32,
             scored: Callable[[int], None] = lambda n: None) -> float:
    """Summed NLL (nats) of ids[1:] given their prefixes.

    window=None carries the state through the whole work in blocks of `block` tokens (any length fits).
    window=N scores the work in independent windows of N tokens, each from the empty state (for models
    whose state grows, like the softmax baseline, and for like-for-like comparisons), `batch` at a time.
    `scored(n)` is told each time n more tokens are scored.
    """
    device = model.wte.weight.device
    inputs, targets = ids[:-1].to(device), ids[1:].to(device)
    if window is None:
        total, state = 0.0, None
        for start in range(0, len(inputs), block):
            logits, state = model(inputs[None, start : start + block], state)  # (1, t, V)
            total += F.cross_entropy(logits[0].float(), targets[start : start + block], reduction="sum").item()
            scored(logits.shape[1])
        return total
    full = len(inputs) // window * window
    windows_in = inputs[:full].view(-1, window)  # (n, N)
    windows_out = targets[:full].view(-1, window)  # (n, N)
    total = 0.0
    for start in range(0, len(windows_in), batch):
        logits, _ = model(windows_in[start : start + batch])  # (b, N, V)
        total += F.cross_entropy(
            logits.flatten(0, 1).float(), windows_out[start : start + batch].flatten(), reduction="sum"
        ).item()
        scored(logits.shape[0] * logits.shape[1])
    if full < len(inputs):
        logits, _ = model(inputs[None, full:])  # (1, r, V)
        total += F.cross_entropy(logits[0].float(), targets[full:], reduction="sum").item()
        scored(logits.shape[1])
    return total


def bits_per_byte(
    model: LinearGPT,
    tokenizer: Tokenizer,
    works: dict[str, str],
    block: int = 2048,
    window: int | None = None,
    max_works: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> EvalResult:
    """Σ NLL / ln 2 / Σ UTF-8 bytes over the works; each work is opened by EOT, as in training.
    `progress(tokens scored, tokens in all, seconds)` is called as scoring goes."""
    was_training = model.training
    model.eval()
    eot = tokenizer.token_to_id(EOT_TOKEN)
    texts = list(works.values())[:max_works]
    encoded = [torch.tensor([eot, *tokenizer.encode(text).ids]) for text in texts]
    total_tokens = sum(len(ids) - 1 for ids in encoded)
    nll, n_tokens, n_bytes = 0.0, 0, 0
    started = time.perf_counter()
    done = 0

    def scored(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total_tokens, time.perf_counter() - started)

    for text, ids in zip(texts, encoded):
        nll += work_nll(model, ids, block, window, scored=scored)
        n_tokens += len(ids) - 1
        n_bytes += len(text.encode("utf-8"))
    seconds = time.perf_counter() - started
    model.train(was_training)
    return EvalResult(
        bits_per_byte=nll / math.log(2) / n_bytes,
        nats_per_token=nll / n_tokens,
        tokens=n_tokens,
        bytes=n_bytes,
        seconds=seconds,
    )
