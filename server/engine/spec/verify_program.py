"""Speculative decoding's verification step as one program: k drafted tokens for every row checked in one
pass from the rows' (S, z), and the state rolled back to the last accepted token — exactly.

A row feeds [pending, d1 … dk]: its pending token (chosen last step, not yet in the state) and its drafts.
The model runs those k + 1 tokens from the row's state (the projections over all of them at once, the
recurrence token by token: `linear_attention.scan`) and keeps the state after
every prefix (the model's `forward(prefixes=True)`), so position j's logits are what a plain decode step
would see after d1 … dj, and the state after any accepted prefix is already there: rolling back is
picking it (`ModelState.select_prefix`), never recomputing.

Acceptance (`accept_drafts`), per row, position by position while j < the row's `limit` (drafts it really
has; 0 = a plain decode step): position j's token is chosen exactly as a plain decode step would choose it
— the argmax for greedy rows, for sampled ones the inverse-CDF draw with the uniform of (seed, absolute
position) — and d(j+1) is accepted while it equals that token. The emitted tokens are therefore the tokens
non-speculative decoding emits, greedy or sampled, whatever was drafted (bit for bit in bf16 on a CPU,
model/numerics.py; to fp32 rounding elsewhere): a session continued, a batch shared or a draft changed never
changes the output. For a
sampled row this is the standard accept/resample rule for a point-mass proposal, realised with shared
uniforms: d is accepted with probability p_j(d), and a rejected position's token is distributed as p_j
without d — so every emitted token is distributed as p, and reproducible under a seed.

Penalties see the drafts: position j's counts include d1 … dj, exactly as j decode steps would have
recorded them. Logit bias is the row's (constrained rows verify no drafts: their mask changes per token).

Like the decode program, it writes what the step decided: each row's state after pending + its accepted drafts
into its slot (a row whose logits were not finite keeps its state: its request fails), and the counts of the
accepted drafts and the next token (not a row the host redraws — a sampled row with filters: the host counts its
redraw). The state it read comes back too, so the host can put the rows back as they were if delivering fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from linserve.model import kernels
from linserve.model.decode_step import flat_verify_step, state_names
from linserve.model.interface import ServedModel

from ..sampling import SlotSampling, count_tokens, counter_uniforms, process_logits, sample_plain, uses_filters

COUNTS = SlotSampling.TENSORS.index("counts")  # where the counts come among the SlotSampling tensors


@dataclass
class VerifyOutputs:
    """What one verification program returns for P rows."""

    emitted: torch.Tensor  # (P, k+1): each position's plain choice — the accepted drafts, then at `kept` the next token
    kept: torch.Tensor  # (P,) int64 drafts accepted, ≤ the row's limit
    finite: torch.Tensor  # (P,) bool: the row's logits were finite
    uniforms: torch.Tensor  # (P,) the next token's uniform (a filtered redraw of a limit-0 row reuses it)
    processed: torch.Tensor  # (P, V) processed logits at the next token's position
    logits: torch.Tensor  # (P, V) the model's logits there
    next: torch.Tensor  # (P,) int64 the token after the accepted drafts (emitted at `kept`)
    redraw: torch.Tensor  # (P,) bool: sampled rows with filters — the host redraws (and counts) their next token
    table: torch.Tensor  # (P, k+5) int64: emitted, kept, next, finite, redraw — what the host reads, in one transfer
    before: list[torch.Tensor]  # the rows' state as the program read it (written back if delivering fails)


def accept_drafts(logits: torch.Tensor, ids: torch.Tensor, limits: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor, floats: torch.Tensor, top_k: torch.Tensor, seed: torch.Tensor,
                  bias: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logits (P, T, V) of feeding ids (P, T) = [pending, d1 … dk]; limits (P,) drafts each row may accept;
    slots, positions (P,) (the position of the token chosen after `pending`); SlotSampling tensors →
    (emitted (P, T), kept (P,), finite (P,), uniforms (P,), processed (P, V), logits (P, V)) — see VerifyOutputs.
    `top_k` is not read: drafts are checked against the unfiltered choice, and the host redraws the next token of
    a row with filters (StepRunner._sampled). On a CPU one pass a row (kernels/sampling.cpp's `verify_choose`: the
    same tokens to the bit), which stops at the row's first rejected draft — `emitted` is −1 after `kept` there."""
    if logits.device.type == "cpu" and kernels.load():
        return tuple(torch.ops.linserve.verify_choose(logits, ids, limits, slots, positions, floats, seed, bias, counts,
                                                      seen))
    P, T, V = logits.shape
    k = T - 1
    rows = torch.arange(P, device=logits.device)  # (P,)
    finite = torch.isfinite(logits).all(dim=-1).all(dim=-1)  # (P,)
    logits = torch.where(finite[:, None, None], logits, torch.zeros_like(logits))  # (P, T, V)
    drafts = ids[:, 1:]  # (P, k)

    drafted = F.one_hot(drafts, V).to(counts.dtype).cumsum(dim=1)  # (P, k, V) drafts up to each position
    added = torch.cat([torch.zeros_like(drafted[:, :1]), drafted], dim=1)  # (P, T, V): position j sees d1 … dj
    row_counts = counts.index_select(0, slots)[:, None] + added  # (P, T, V)
    row_seen = seen.index_select(0, slots)[:, None] | (added > 0)  # (P, T, V)
    row_floats = floats.index_select(1, slots)  # (6, P)
    processed = process_logits(
        logits.reshape(P * T, V), row_floats.repeat_interleave(T, dim=1),
        bias.index_select(0, slots).repeat_interleave(T, dim=0), row_counts.reshape(P * T, V),
        row_seen.reshape(P * T, V)).view(P, T, V)  # (P, T, V)

    temperature = row_floats[0]  # (P,)
    at = (positions[:, None] + torch.arange(T, device=logits.device)).reshape(-1)  # (P*T,) absolute positions
    row_seed = seed.index_select(0, slots)[:, None].expand(P, T).reshape(-1)  # (P*T,)
    uniforms = counter_uniforms(row_seed, at)  # (P*T,) what decode steps at these positions draw with
    chosen = sample_plain(processed.reshape(P * T, V), temperature.repeat_interleave(T), uniforms).view(P, T)

    ok = chosen[:, :k] == drafts  # (P, k) the plain choice at position j is the draft d(j+1)
    ok = ok & (torch.arange(k, device=logits.device)[None, :] < limits[:, None])  # (P, k)
    kept = ok.long().cumprod(dim=1).sum(dim=1)  # (P,) the accepted prefix's length
    # the accepted drafts are the chosen tokens before `kept`; the row's next token is the one at `kept`
    return chosen, kept, finite, uniforms.view(P, T)[rows, kept], processed[rows, kept], logits[rows, kept]


def verify_program(model: ServedModel, k: int):
    """The verification step as one function of tensors — what gets compiled per bucket:

        program(ids (k+1, P), limits (P,), slots (P,), positions (P,), *pool buffers, *SlotSampling tensors)
            -> (emitted (P, k+1), kept, finite, uniforms, processed, logits, next, redraw, table, *state read)

    It writes each finite row's state after its accepted prefix into its slot, and counts the accepted drafts and
    the next token (not a redrawn row's) — as the decode program writes its step (the caller settles the slots'
    pending updates first: the program reads the buffers as they are). Rows padded to a bucket repeat the first
    row (same slot, same values): their writes are the same bits."""
    if k < 1:
        raise ValueError(f"a verification step checks at least one draft, got k={k}")
    step = flat_verify_step(model)
    n_state = len(state_names(model))

    def program(ids: torch.Tensor, limits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pool, sampling = buffers[:n_state], buffers[n_state:]
        state = [buffer.index_select(0, slots) for buffer in pool]  # (P, …) each
        rows_ids = ids.transpose(0, 1)  # (P, k+1)
        logits, *prefixes = step(rows_ids, *state)  # (P, k+1, V), then (P, k+1, …) each
        emitted, kept, finite, uniforms, processed, last = accept_drafts(logits, rows_ids, limits, slots, positions,
                                                                         *sampling)
        rows = torch.arange(kept.shape[0], device=kept.device)  # (P,)
        nexts = emitted[rows, kept]  # (P,) the token after the accepted drafts
        floats, top_k = sampling[0].index_select(1, slots), sampling[1].index_select(0, slots)  # (6, P), (P,)
        redraw = (floats[0] > 0) & uses_filters(top_k, floats[1], floats[2])  # (P,) sampled rows with filters
        for j in range(k + 1):  # the accepted drafts, then the next token: one position at a time (a row's tokens
            # may repeat; emitted is −1 after `kept` where the kernel stopped)
            count_tokens(sampling[COUNTS], slots, emitted[:, j].clamp(min=0),
                         finite & ((j < kept) | ((j == kept) & ~redraw)))
        for buffer, old, prefix in zip(pool, state, prefixes):
            new = prefix[rows, kept]  # (P, …) the state after pending + the accepted drafts
            keep = finite.view(-1, *([1] * (new.dim() - 1)))  # (P, 1, …)
            buffer.index_copy_(0, slots, torch.where(keep, new.to(buffer.dtype), old))
        table = torch.cat([emitted, torch.stack([kept, nexts, finite.long(), redraw.long()], dim=1)], dim=1)
        return (emitted, kept, finite, uniforms, processed, last, nexts, redraw, table, *state)  # (P, k+5) table

    return program
