"""Batched sampling as a pure function of logits and per-row parameters.

Randomness comes in as one uniform number per row, drawn by the caller from that row's own seeded
generator, so a seeded request samples the same tokens whatever else shares its batch: the choice is
inverse-CDF over the filtered distribution, with no batch-wide random draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .types import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class BatchParams:
    """Per-row sampling parameters as tensors (B,) on the logits' device."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    any_random: bool
    any_filter: bool
    any_penalty: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> BatchParams:
        def col(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        return cls(
            temperature=col("temperature"),
            top_k=col("top_k", torch.long),
            top_p=col("top_p"),
            min_p=col("min_p"),
            repetition_penalty=col("repetition_penalty"),
            presence_penalty=col("presence_penalty"),
            frequency_penalty=col("frequency_penalty"),
            any_random=any(not p.greedy for p in params),
            any_filter=any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params if not p.greedy),
            any_penalty=any(p.uses_penalties for p in params),
        )


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, bp: BatchParams) -> torch.Tensor:
    """logits (B, V); counts (B, V) of generated tokens; seen (B, V) bool over prompt + generated."""
    rep = bp.repetition_penalty[:, None]  # (B, 1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # (B, V)
    logits = torch.where(seen, penalised, logits)  # (B, V)
    logits = logits - bp.frequency_penalty[:, None] * counts  # (B, V)
    return logits - bp.presence_penalty[:, None] * (counts > 0).float()  # (B, V)


def sample(logits: torch.Tensor, bp: BatchParams, uniforms: torch.Tensor) -> torch.Tensor:
    """logits (B, V) fp32 → token ids (B,). Rows with temperature 0 take the argmax."""
    greedy = logits.argmax(dim=-1)  # (B,)
    if not bp.any_random:
        return greedy
    temperature = torch.where(bp.temperature > 0, bp.temperature, torch.ones_like(bp.temperature))  # (B,)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)  # (B, V)
    if bp.any_filter:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]  # (1, V)
        k = torch.where(bp.top_k > 0, bp.top_k, torch.full_like(bp.top_k, probs.shape[-1]))  # (B,)
        drop = ranks >= k[:, None]  # (B, V)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V) mass strictly before each rank
        drop |= before >= bp.top_p[:, None]
        drop |= sorted_probs < bp.min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        kept = sorted_probs.masked_fill(drop, 0.0)  # (B, V)
    else:
        kept, order = probs, None
    cdf = kept.cumsum(dim=-1)  # (B, V)
    target = uniforms[:, None] * cdf[:, -1:]  # (B, 1)
    index = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)  # (B, 1)
    chosen = index[:, 0] if order is None else order.gather(1, index)[:, 0]  # (B,)
    return torch.where(bp.temperature > 0, chosen, greedy)  # (B,)


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model gives (almost) no mass


def json_safe_logprob(value: float) -> float:
    """Log-probabilities leave the engine finite: -inf (or NaN) becomes the floor, so JSON never sees them."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> list[TokenLogprob | None]:
    """Log-probabilities of the model's distribution (before penalties and temperature) for rows that ask."""
    wanted = [i for i, n in enumerate(top_n) if n is not None]
    if not wanted:
        return [None] * len(top_n)
    rows = torch.tensor(wanted, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)  # (b, V)
    chosen = logp.gather(1, tokens.index_select(0, rows)[:, None])[:, 0].tolist()  # (b,)
    widest = max(top_n[i] for i in wanted)
    top_values, top_ids = logp.topk(max(widest, 1), dim=-1)  # (b, N)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = [None] * len(top_n)
    for j, i in enumerate(wanted):
        n = top_n[i]
        alternatives = tuple((t, json_safe_logprob(v)) for t, v in zip(top_ids[j][:n], top_values[j][:n]))
        out[i] = TokenLogprob(token_id=int(tokens[i]), logprob=json_safe_logprob(chosen[j]), top=alternatives)
    return out
