"""The delta rule (DeltaNet, Schlag et al. 2021; Yang et al. 2024) and its gated form (Gated DeltaNet, Yang et
al. 2025 — Qwen3-Next's linear layer), per head, in its two forms:

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ        o_t = S_tᵀ q_t

S (d_k, d_v) fp32; β_t ∈ (0, 1] (or (0, 2] with negative eigenvalues) the write strength; α_t = exp(g_t) a decay
per head and token (the gated form; α = 1 for DeltaNet). Equivalently u_t = β_t (v_t − α_t S_{t-1}ᵀ k_t) is
what the token writes: S_t = α_t S_{t-1} + k_t u_tᵀ. The caller normalises k and scales q.

- `chunked`: the chunkwise-parallel form (prefill, fp32/CUDA) — the WY / UT-transform representation of
  Yang et al. 2024: within a chunk of C tokens, with Γ_t = Σ_{s≤t} g_s from the chunk's start,

      (I + A) U = β ⊙ V − (β e^Γ ⊙ K) S₀,   A_ts = β_t e^{Γ_t−Γ_s} k_tᵀk_s  (s < t)

  is one unit-lower-triangular solve for every token's write U at once (U = U₀ − W S₀ with U₀, W from the
  chunk alone), then O = (e^Γ ⊙ Q) S₀ + (QKᵀ ⊙ e^{Γ_t−Γ_s})_{s≤t} U and S = e^{Γ_C} S₀ + (e^{Γ_C−Γ} ⊙ K)ᵀ U:
  O(T·C) work, matrix products rather than a token loop.
- `scan`: token after token, bit for bit what single steps give wherever a sequence is split, reductions over
  d_k in a fixed order (`numerics.tree_sum`): decoding, the exact bf16 path and the state after every prefix.
Both compute the same function (tests/model/test_delta_rule.py).
"""

from __future__ import annotations

import torch

from . import kernels, numerics
from .pooled_state import PendingUpdate, PooledState, gathered, readable

CHUNK = 64  # tokens per chunk (fla's chunk size): one (C, C) triangular solve per chunk and head
NEGLIGIBLE_LOG = -60.0  # decays below e^-60 (≈ 1e-26) count as 0: never a subnormal float in the products


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp, flushed to 0 below e^NEGLIGIBLE_LOG: strongly forgetting heads would otherwise fill the chunk's
    matrices with subnormal numbers, which CPUs multiply ~10× slower (measured: 4 ms vs 0.35 ms a product)."""
    return torch.where(log_decay > NEGLIGIBLE_LOG, log_decay, float("-inf")).exp()


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
            S: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, H, T, dk); v (B, H, T, dv); beta (B, H, T); g (B, H, T) log decay or None; S (B, H, dk, dv)
    fp32 → o (B, H, T, dv) fp32 and the state after the T tokens."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    outs = []
    for start in range(0, T, chunk):
        qc, kc, vc = q[:, :, start:start + chunk], k[:, :, start:start + chunk], v[:, :, start:start + chunk]
        bc = beta[:, :, start:start + chunk, None]  # (B, H, C, 1)
        C = qc.shape[2]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C, C): s ≤ t
        if g is None:
            decay = lower.float()  # (C, C)
            to_start = to_end = None
        else:
            G = g[:, :, start:start + chunk].float().cumsum(-1)  # (B, H, C): log decay from the chunk's start
            decay = _decay((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))  # (B, H, C, C)
            to_start, to_end = _decay(G)[..., None], _decay(G[..., -1:] - G)[..., None]  # (B, H, C, 1) each
        A = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)  # (B, H, C, C): strictly lower
        eye = torch.eye(C, device=q.device, dtype=torch.float32)
        rhs = torch.cat([bc * vc, bc * kc * (1 if to_start is None else to_start)], dim=-1)  # (B, H, C, dv+dk)
        solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # (B, H, C, dv+dk)
        U = solved[..., :dv] - solved[..., dv:] @ S  # (B, H, C, dv): each token's write
        scores = (qc @ kc.transpose(-1, -2)) * decay  # (B, H, C, C), s ≤ t
        o = (qc if to_start is None else qc * to_start) @ S + scores @ U  # (B, H, C, dv)
        if g is None:
            S = S + kc.transpose(-1, -2) @ U  # (B, H, dk, dv)
        else:
            S = _decay(G[..., -1, None, None]) * S + (kc * to_end).transpose(-1, -2) @ U  # (B, H, dk, dv)
        outs.append(o)
    return torch.cat(outs, dim=2) if outs else v.new_zeros(B, H, 0, dv, dtype=torch.float32), S


def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
         S: torch.Tensor, prefixes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens one at a time (shapes as `chunked`); with `prefixes`, the state after every prefix
    (B, T, H, dk, dv)."""
    B, H, T, dk = q.shape
    alpha = None if g is None else numerics.exp(g.float())  # (B, H, T)
    if S.device.type == "cpu" and kernels.load():  # the T tokens in one call, the state in the cache (delta_rule.cpp)
        return torch.ops.linserve.delta_scan(q.float(), k.float(), v.float(), beta.float(), alpha, S.float(),
                                             prefixes)  # (B, H, T, dv), state
    outs, states = [], []
    for t in range(T):
        kt = k[:, :, t, :, None].float()  # (B, H, dk, 1)
        if alpha is not None:
            S = S * alpha[:, :, t, None, None]  # (B, H, dk, dv)
        predicted = numerics.tree_sum(kt * S, -2)  # (B, H, dv): S_{t-1}ᵀ k_t, decayed
        u = beta[:, :, t, None].float() * (v[:, :, t].float() - predicted)  # (B, H, dv)
        S = S + kt * u[:, :, None, :]  # (B, H, dk, dv)
        outs.append(numerics.tree_sum(q[:, :, t, :, None].float() * S, -2))  # (B, H, dv)
        if prefixes:
            states.append(S)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1], dtype=torch.float32)
    return o, (torch.stack(states, dim=1) if prefixes else S)  # (B, H, T, dv), state


def read_pooled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
                S: PooledState) -> tuple[torch.Tensor, PendingUpdate]:
    """One token from the rows' slots in the pool (`linserve::delta_read`: the scan's bits, the state not
    written) and the update S ← S·α + k ⊗ u the decode program commits. Shapes as `scan`, T = 1."""
    alpha = None if g is None else numerics.exp(g[:, :, 0].float()).contiguous()  # (B, H)
    q, k, v = q[:, :, 0].float().contiguous(), k[:, :, 0].float().contiguous(), v[:, :, 0].float().contiguous()
    beta = beta[:, :, 0].float().contiguous()  # (B, H)
    if S.pending is not None:  # the slots' pending updates applied as they are read
        o, u = torch.ops.linserve.delta_read_folded(q, k, v, beta, alpha, S.pool, S.slots, *S.pending.tensors())
    else:
        o, u = torch.ops.linserve.delta_read(q, k, v, beta, alpha, S.pool, S.slots)
    return o[:, :, None], PendingUpdate(S.pool, S.slots, k, u, alpha, S.pending)  # (B, H, 1, dv)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
        S: torch.Tensor | PooledState, exact: bool, prefixes: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor | PendingUpdate]:
    """The scan for one token, the exact path and every-prefix states; else the chunkwise form. A state still
    in the pool (one decode token) is read there, its update returned pending (pooled_state.py)."""
    if readable(S, q.shape[2], prefixes):
        return read_pooled(q, k, v, beta, g, S)
    S = gathered(S)
    if exact or prefixes or q.shape[2] <= 1:
        return scan(q, k, v, beta, g, S, prefixes)
    return chunked(q, k, v, beta, g, S)


def l2_normalize(x: torch.Tensor, exact: bool, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dimension, in fp32 (fla's in-kernel q/k normalisation)."""
    x = x.float()
    if exact:
        return x / numerics.sqrt(numerics.tree_sum(x * x, -1) + eps)[..., None]
    return x / torch.sqrt((x * x).sum(-1) + eps)[..., None]
