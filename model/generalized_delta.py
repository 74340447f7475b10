"""RWKV-7's recurrence — the generalised delta rule with a decay per key dimension (fla's `rwkv7` ops), per head:

    S_t = diag(e^{w_t}) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ        o_t = S_tᵀ r_t

S (d_k, d_v) fp32; w_t ≤ 0 the log decay per key dimension; a_t, b_t the rank-one correction (RWKV-7: a = −κ̂,
b = κ̂ ⊙ a_gate, κ̂ the normalised key, so the state forgets along κ̂ before it writes k vᵀ). With u_t = a_tᵀ S_{t-1}
(the row the token reads back), S_t = e^{w_t} ⊙ S_{t-1} + b_t u_t + k_t v_tᵀ.

- `chunked`: the chunkwise form (prefill, fp32/CUDA). Within a chunk of C tokens, with G_t = Σ_{s≤t} w_s from the
  chunk's start and Ĝ_t = G_t − w_t (the decay before token t):

      (I − M_b) U = (a ⊙ e^Ĝ) S₀ + M_k V,    M_x[t, s] = Σ_d a_t e^{Ĝ_t − G_s} x_s   (s < t)

  is one unit-lower-triangular solve for every token's read-back U, then
  O = (r ⊙ e^G) S₀ + Q_k V + Q_b U with Q_x[t, s] = Σ_d r_t e^{G_t − G_s} x_s (s ≤ t), and
  S = e^{G_C} ⊙ S₀ + (k ⊙ e^{G_C − G})ᵀ V + (b ⊙ e^{G_C − G})ᵀ U. Every exponent is ≤ 0 (no overflow).
- `scan`: token after token, reductions over d_k in a fixed order (`numerics.tree_sum`): decoding, the exact bf16
  path and the state after every prefix — bit for bit what single steps give wherever a sequence is split.
Both compute the same function (tests/model/test_generalized_delta.py).
"""

from __future__ import annotations

import torch

from . import kernels, numerics

CHUNK = 32  # tokens per chunk: the (C, C, d_k) decay tensors stay small


def _pairwise(G_rows: torch.Tensor, G_cols: torch.Tensor, strict: bool) -> torch.Tensor:
    """e^{G_rows[t] − G_cols[s]} per key dimension where s < t (strict) or s ≤ t, else 0: (B, H, C, C, dk)."""
    C = G_rows.shape[2]
    keep = torch.ones(C, C, dtype=torch.bool, device=G_rows.device).tril(-1 if strict else 0)  # (C, C)
    diff = G_rows[:, :, :, None, :] - G_cols[:, :, None, :, :]  # (B, H, C, C, dk)
    return diff.masked_fill(~keep[:, :, None], float("-inf")).exp()


def chunked(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            S: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """r, w, k, a, b (B, H, T, dk); v (B, H, T, dv); S (B, H, dk, dv) fp32 → o (B, H, T, dv) fp32, state after."""
    B, H, T, dk = r.shape
    r, w, k, v, a, b = (t.float() for t in (r, w, k, v, a, b))
    outs = []
    for start in range(0, T, chunk):
        rc, wc, kc, vc, ac, bc = (t[:, :, start:start + chunk] for t in (r, w, k, v, a, b))
        C = rc.shape[2]
        G = wc.cumsum(2)  # (B, H, C, dk): log decay from the chunk's start through token t
        before = G - wc  # (B, H, C, dk): through token t - 1
        read = _pairwise(before, G, strict=True)  # (B, H, C, C, dk)
        Mk = (ac[:, :, :, None] * read * kc[:, :, None]).sum(-1)  # (B, H, C, C)
        Mb = (ac[:, :, :, None] * read * bc[:, :, None]).sum(-1)  # (B, H, C, C) strictly lower
        eye = torch.eye(C, device=r.device, dtype=torch.float32)
        rhs = (ac * before.exp()) @ S + Mk @ vc  # (B, H, C, dv)
        U = torch.linalg.solve_triangular(eye - Mb, rhs, upper=False, unitriangular=True)  # (B, H, C, dv)
        write = _pairwise(G, G, strict=False)  # (B, H, C, C, dk)
        Qk = (rc[:, :, :, None] * write * kc[:, :, None]).sum(-1)  # (B, H, C, C)
        Qb = (rc[:, :, :, None] * write * bc[:, :, None]).sum(-1)  # (B, H, C, C)
        outs.append((rc * G.exp()) @ S + Qk @ vc + Qb @ U)  # (B, H, C, dv)
        to_end = (G[:, :, -1:] - G).exp()  # (B, H, C, dk)
        S = G[:, :, -1, :, None].exp() * S + (kc * to_end).transpose(-1, -2) @ vc \
            + (bc * to_end).transpose(-1, -2) @ U  # (B, H, dk, dv)
    return torch.cat(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1]), S


def scan(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         S: torch.Tensor, prefixes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens one at a time (fla's recurrent kernel's order: decay and read-back, then the write). Shapes as
    `chunked`; with `prefixes` the state after every prefix (B, T, H, dk, dv)."""
    B, H, T, dk = r.shape
    decay = numerics.exp(w.float())  # (B, H, T, dk)
    r, k, v, a, b = (t.float() for t in (r, k, v, a, b))
    outs, states = [], []
    on_kernel = S.device.type == "cpu" and kernels.load()  # one pass over the state a token (kernels/delta_rule.cpp)
    for t in range(T):
        if on_kernel:
            o, S = torch.ops.linserve.dplr_step(r[:, :, t], decay[:, :, t], k[:, :, t], v[:, :, t], a[:, :, t],
                                                b[:, :, t], S)  # (B, H, dv), state
            outs.append(o)
        else:
            read_back = numerics.tree_sum(a[:, :, t, :, None] * S, -2)  # (B, H, dv): a_tᵀ S_{t-1}
            S = decay[:, :, t, :, None] * S + b[:, :, t, :, None] * read_back[:, :, None, :]  # (B, H, dk, dv)
            S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
            outs.append(numerics.tree_sum(r[:, :, t, :, None] * S, -2))  # (B, H, dv)
        if prefixes:
            states.append(S)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1], dtype=torch.float32)
    return o, (torch.stack(states, dim=1) if prefixes else S)


def run(r, w, k, v, a, b, S: torch.Tensor, exact: bool, prefixes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan for one token, the exact path and every-prefix states; else the chunkwise form."""
    if exact or prefixes or r.shape[2] <= 1:
        return scan(r, w, k, v, a, b, S, prefixes)
    return chunked(r, w, k, v, a, b, S)
