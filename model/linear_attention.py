"""The maths of causal linear attention, in its two forms.

Per head, with features φ(q_t), φ(k_t) (d_k) and values v_t (d_v), optional decay γ (1 without):

    S_t = γ·S_{t-1} + φ(k_t) v_tᵀ        (d_k, d_v)
    z_t = γ·z_{t-1} + φ(k_t)             (d_k,)
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)

`recurrent_step` is that recurrence for one token. `chunked_forward` computes the same function for
T tokens at once: inside a chunk of C tokens a masked (C, C) product, across chunks the state carried
forward, so memory is O(C² + d_k·d_v) per head and chunk, never O(T²). z rides along as an extra
value column of ones, so numerator and denominator come out of the same products.

Every tensor here is fp32 (callers cast); states are returned, never mutated in place.
"""

from __future__ import annotations

import torch


def decay_powers(log_decay: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """γ_h^i for i in [0, n): (H, n), in `like`'s dtype and device. All ones without decay."""
    n_heads = like.shape[1]
    if log_decay is None:
        return like.new_ones(n_heads, n)  # (H, n)
    steps = torch.arange(n, device=like.device, dtype=like.dtype)  # (n,)
    return torch.exp(log_decay.to(like.dtype)[:, None] * steps[None, :])  # (H, n)


def _intra_chunk_weights(log_decay: torch.Tensor | None, size: int, like: torch.Tensor) -> torch.Tensor:
    """Causal weights γ^(i-j) for j <= i else 0 inside a chunk: (H, C, C)."""
    i = torch.arange(size, device=like.device)
    distance = (i[:, None] - i[None, :]).to(like.dtype)  # (C, C)
    causal = (distance >= 0).to(like.dtype)  # (C, C)
    if log_decay is None:
        return causal.expand(like.shape[1], size, size)  # (H, C, C)
    return torch.exp(log_decay.to(like.dtype)[:, None, None] * distance.clamp(min=0)) * causal  # (H, C, C)


def _chunks(phi_q, phi_k, v_ext, S0, log_decay):
    """Linear attention over N equal chunks. Inputs (B, H, N, C, ·); S0 (B, H, d_k, d_v+1).

    Returns the extended outputs (B, H, N, C, d_v+1) and the final extended state.
    """
    B, H, N, C, _ = phi_q.shape
    powers = decay_powers(log_decay, C + 1, phi_q)  # (H, C+1): γ^0 … γ^C
    intra_w = _intra_chunk_weights(log_decay, C, phi_q)  # (H, C, C)

    scores = phi_q @ phi_k.transpose(-1, -2)  # (B, H, N, C, C)
    intra = (scores * intra_w[:, None]) @ v_ext  # (B, H, N, C, dv+1)

    key_w = powers[:, :C].flip(-1)  # (H, C): γ^(C-1-j)
    deltas = (phi_k * key_w[:, None, :, None]).transpose(-1, -2) @ v_ext  # (B, H, N, dk, dv+1)

    if log_decay is None:
        ends = S0[:, :, None] + deltas.cumsum(dim=2)  # (B, H, N, dk, dv+1)
        starts = torch.cat([S0[:, :, None], ends[:, :, :-1]], dim=2)  # (B, H, N, dk, dv+1)
        final = ends[:, :, -1]  # (B, H, dk, dv+1)
    else:
        carry = powers[:, C][None, :, None, None]  # (1, H, 1, 1): γ^C
        starts_list, state = [], S0
        for n in range(N):
            starts_list.append(state)
            state = carry * state + deltas[:, :, n]  # (B, H, dk, dv+1)
        starts = torch.stack(starts_list, dim=2)  # (B, H, N, dk, dv+1)
        final = state

    query_w = powers[:, 1:]  # (H, C): γ^(i+1)
    inter = (phi_q * query_w[:, None, :, None]) @ starts  # (B, H, N, C, dv+1)
    return intra + inter, final


def chunked_forward(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    log_decay: torch.Tensor | None,
    chunk_size: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parallel form. phi_q, phi_k (B, H, T, dk); v (B, H, T, dv); S (B, H, dk, dv); z (B, H, dk).

    Returns o (B, H, T, dv) and the state (S, z) after the T tokens.
    """
    B, H, T, dk = phi_q.shape
    dv = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, H, 0, dv), S, z
    ones = torch.ones(B, H, T, 1, device=v.device, dtype=v.dtype)
    v_ext = torch.cat([v, ones], dim=-1)  # (B, H, T, dv+1)
    state = torch.cat([S, z[..., None]], dim=-1)  # (B, H, dk, dv+1)

    full = (T // chunk_size) * chunk_size
    pieces = []
    spans = [(0, full, chunk_size)] if full else []
    if T > full:
        spans.append((full, T, T - full))  # the remainder as one shorter chunk
    for start, stop, size in spans:
        n = (stop - start) // size
        shape = (B, H, n, size, -1)
        out, state = _chunks(
            phi_q[:, :, start:stop].reshape(shape),  # (B, H, n, C, dk)
            phi_k[:, :, start:stop].reshape(shape),  # (B, H, n, C, dk)
            v_ext[:, :, start:stop].reshape(shape),  # (B, H, n, C, dv+1)
            state,
            log_decay,
        )
        pieces.append(out.reshape(B, H, stop - start, dv + 1))  # (B, H, t, dv+1)

    out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]  # (B, H, T, dv+1)
    o = out[..., :dv] / (out[..., dv:] + eps)  # (B, H, T, dv)
    return o, state[..., :dv].contiguous(), state[..., dv].contiguous()


def prefix_states(
    phi_k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    log_decay: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after every prefix of T tokens, from the state before them (speculative decoding's
    rollback: the state after any accepted prefix comes out of the one verification pass).

    phi_k (B, H, T, dk); v (B, H, T, dv); S (B, H, dk, dv); z (B, H, dk) →
    S_all (B, T, H, dk, dv), z_all (B, T, H, dk) with S_all[:, j] = γ^(j+1)·S + Σ_{i≤j} γ^(j-i) φ(k_i) v_iᵀ,
    which is what j + 1 recurrent steps give (within fp tolerance).
    """
    T = phi_k.shape[2]
    ones = torch.ones(*v.shape[:-1], 1, device=v.device, dtype=v.dtype)
    v_ext = torch.cat([v, ones], dim=-1)  # (B, H, T, dv+1): z rides as a column of ones
    weights = _intra_chunk_weights(log_decay, T, phi_k)  # (H, T, T): γ^(j-i) for i ≤ j
    outer = phi_k[..., :, None] * v_ext[..., None, :]  # (B, H, T, dk, dv+1)
    added = torch.einsum("hji,bhixy->bjhxy", weights, outer)  # (B, T, H, dk, dv+1)
    carry = decay_powers(log_decay, T + 1, phi_k)[:, 1:].T  # (T, H): γ^(j+1)
    start = torch.cat([S, z[..., None]], dim=-1)  # (B, H, dk, dv+1)
    states = added + carry[None, :, :, None, None] * start[:, None]  # (B, T, H, dk, dv+1)
    return states[..., :-1], states[..., -1]


def recurrent_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    log_decay: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recurrent form for one token. phi_q, phi_k (B, H, dk); v (B, H, dv); S (B, H, dk, dv); z (B, H, dk).

    Written as few full-state passes as possible (decode is bound by them at large batch): one
    multiply-add builds the new S, one the new z; the inputs are never modified.
    """
    if log_decay is not None:
        gamma = torch.exp(log_decay.to(S.dtype))  # (H,)
        S = torch.addcmul(gamma[:, None, None] * S, phi_k[..., :, None], v[..., None, :])  # (B, H, dk, dv)
        z = torch.addcmul(phi_k, gamma[:, None], z)  # (B, H, dk)
    else:
        S = torch.addcmul(S, phi_k[..., :, None], v[..., None, :])  # (B, H, dk, dv)
        z = z + phi_k  # (B, H, dk)
    num = (phi_q[..., None, :] @ S).squeeze(-2)  # (B, H, dv)
    den = (phi_q * z).sum(dim=-1, keepdim=True)  # (B, H, 1)
    return num / (den + eps), S, z
