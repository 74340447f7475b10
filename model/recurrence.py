"""The gated linear recurrence that fla's linear families share, in its two forms.

    S_t = diag(α_t) · S_{t-1} + k_t v_tᵀ        o_t = S_tᵀ q_t

per head, with S (d_k, d_v) fp32 and the decay α_t = exp(g_t) one of: none (linear_attn: α = 1), a fixed
per-head scalar (RetNet: log γ_h), or data-dependent per key dimension (GLA: g_t (d_k,)). The caller scales q
(fla's d_k^-½). A normaliser (linear_attn's `norm_feature_map`: o_t / qᵀz_t, z_t = Σ k) rides as one more value
column of ones, as the shipped model's z does.

- `chunked`: the chunkwise-parallel form (prefill, fp32/CUDA): within a chunk of C tokens the outputs are a
  masked (C, C) product, across chunks the state is carried — O(T·C) work and memory, not O(T²).
- `scan`: token after token, bit for bit what T single steps give wherever a sequence is split; the form of
  decoding, of the exact bf16 path (numerics.exact_inference) and of the state after every prefix
  (speculative verification).
Both compute the same function (tests/model/test_recurrence.py).
"""

from __future__ import annotations

import torch

from . import kernels, numerics
from .pooled_state import PendingUpdate, PooledState, gathered, readable

CHUNK = 32  # tokens per chunk of the chunkwise form: its (C, C, d_k) gate tensor stays small

Gate = torch.Tensor | None  # None · (H,) log γ per head · (B, H, T, dk) log α per token and key dimension


def _cumulative(gate: Gate, B: int, H: int, T: int, like: torch.Tensor) -> torch.Tensor | None:
    """Σ_{s≤t} log α_s within the sequence: (B, H, T, 1) for a per-head decay, (B, H, T, dk) for a gate."""
    if gate is None:
        return None
    if gate.dim() == 1:  # (H,) constant per head
        steps = torch.arange(1, T + 1, device=like.device, dtype=torch.float32)  # (T,)
        return (gate.float()[:, None] * steps)[None, :, :, None].expand(B, H, T, 1)  # (B, H, T, 1)
    return gate.float().cumsum(2)  # (B, H, T, dk)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Gate, S: torch.Tensor,
            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, H, T, dk); v (B, H, T, dv); S (B, H, dk, dv) fp32 → o (B, H, T, dv) fp32 and the state after."""
    B, H, T, dk = q.shape
    q, k, v = q.float(), k.float(), v.float()
    outs = []
    for start in range(0, T, chunk):
        qc, kc, vc = q[:, :, start:start + chunk], k[:, :, start:start + chunk], v[:, :, start:start + chunk]
        C = qc.shape[2]
        G = _cumulative(None if gate is None else (gate if gate.dim() == 1 else gate[:, :, start:start + chunk]),
                        B, H, C, qc)  # (B, H, C, 1 or dk): log decay from the chunk's start to t
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C, C): s ≤ t
        if G is None:
            scores = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0)  # (B, H, C, C)
            o = qc @ S + scores @ vc  # (B, H, C, dv)
            S = S + kc.transpose(-1, -2) @ vc  # (B, H, dk, dv)
        else:
            last = G[:, :, -1:]  # (B, H, 1, ·): the whole chunk's decay
            if G.shape[-1] == 1:  # a per-head decay: the (C, C) decay matrix
                diff = (G - G.transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # (B, H, C, C)
                scores = (qc @ kc.transpose(-1, -2)) * diff.exp()  # (B, H, C, C)
            else:  # a gate per key dimension: exp(G_t - G_s) per (t, s, dk), s ≤ t only (no overflow)
                diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # (B, H, C, C, dk)
                diff = diff.masked_fill(~causal[:, :, None], float("-inf"))
                scores = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * diff.exp()).sum(-1)  # (B, H, C, C)
            o = (qc * G.exp()) @ S + scores @ vc  # (B, H, C, dv)
            decay_to_end = (last - G).exp()  # (B, H, C, ·): from each token to the chunk's end
            S = last.transpose(-1, -2).exp() * S + (kc * decay_to_end).transpose(-1, -2) @ vc  # (B, H, dk, dv)
        outs.append(o)
    return torch.cat(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1]), S


def decay_factors(gate: Gate) -> torch.Tensor | None:
    """α = exp(log α) in fp32 through `numerics.exp` (the same bits eager and compiled)."""
    return None if gate is None else numerics.exp(gate.float())


def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Gate, S: torch.Tensor,
         prefixes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens through the recurrence one at a time; every state element follows its own chain of the same
    roundings (product, then sum), and outputs are read with `numerics.tree_sum` over d_k (a fixed order).

    q, k (B, H, T, dk); v (B, H, T, dv); S (B, H, dk, dv) fp32 → o (B, H, T, dv) fp32 and the state after the
    T tokens — or, with `prefixes`, the state after every prefix (B, T, H, dk, dv)."""
    B, H, T, dk = q.shape
    alpha = decay_factors(gate)  # (H,) or (B, H, T, dk or 1) or None
    outs, states = [], []
    if S.device.type == "cpu" and kernels.load():  # one call: each head's state stays in cache (kernels/delta_rule.cpp)
        if alpha is not None:  # the factor of every key dimension, per row and token: (B, H, T, dk)
            alpha = (alpha[None, :, None, None] if alpha.dim() == 1 else alpha).expand(B, H, T, dk).contiguous()
        return torch.ops.linserve.linear_scan(q.float(), k.float(), v.float(), alpha, S, prefixes)  # o, state
    for t in range(T):
        outer = k[:, :, t, :, None].float() * v[:, :, t, None, :].float()  # (B, H, dk, dv)
        if alpha is not None:
            S = S * (alpha[:, None, None] if alpha.dim() == 1 else alpha[:, :, t, :, None])  # (B, H, dk, dv)
        S = S + outer  # (B, H, dk, dv)
        outs.append(numerics.tree_sum(q[:, :, t, :, None].float() * S, -2))  # (B, H, dv)
        if prefixes:
            states.append(S)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1], dtype=torch.float32)
    return o, (torch.stack(states, dim=1) if prefixes else S)  # (B, H, T, dv), state


def read_pooled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Gate,
                S: PooledState) -> tuple[torch.Tensor, PendingUpdate]:
    """One token from the rows' slots in the pool (`linserve::linear_read`: scan's bits, the state not written) and
    the update the decode program commits once the step's rows are known good. Shapes as `scan`, T = 1."""
    B, H, _, dk = q.shape
    alpha = decay_factors(gate)  # (H,) or (B, H, 1, dk or 1) or None
    if alpha is not None:  # the factor of every key dimension, per row: (B, H, dk)
        alpha = (alpha[None, :, None, None] if alpha.dim() == 1 else alpha).expand(B, H, 1, dk)[:, :, 0].contiguous()
    q, k, v = q[:, :, 0].float().contiguous(), k[:, :, 0].float().contiguous(), v[:, :, 0].float().contiguous()
    if S.pending is not None:  # the slots' pending updates applied as they are read
        o = torch.ops.linserve.linear_read_folded(q, k, v, alpha, S.pool, S.slots, *S.pending.tensors())  # (B, H, dv)
    else:
        o = torch.ops.linserve.linear_read(q, k, v, alpha, S.pool, S.slots)  # (B, H, dv)
    return o[:, :, None], PendingUpdate(S.pool, S.slots, k, v, alpha, S.pending)  # (B, H, 1, dv)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Gate, S: torch.Tensor | PooledState, exact: bool,
        prefixes: bool = False) -> tuple[torch.Tensor, torch.Tensor | PendingUpdate]:
    """The form for this call: the scan for one token, the exact path and every-prefix states; else the
    chunkwise form. Shapes as `scan`. A state still in the pool (one decode token) is read there and its update
    returned pending (pooled_state.py); with several tokens or without the kernels, it is gathered first."""
    if readable(S, q.shape[2], prefixes):
        return read_pooled(q, k, v, gate, S)
    S = gathered(S)
    if exact or prefixes or q.shape[2] <= 1:
        return scan(q, k, v, gate, S, prefixes)
    return chunked(q, k, v, gate, S)
