"""The maths of causal linear attention, in its forms.

Per head, with features φ(q_t), φ(k_t) (d_k) and values v_t (d_v), optional decay γ (1 without):

    S_t = γ·S_{t-1} + φ(k_t) v_tᵀ        (d_k, d_v)
    z_t = γ·z_{t-1} + φ(k_t)             (d_k,)
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)

`recurrent_step` is that recurrence for one token. `chunked_forward` computes the same function for
T tokens at once: inside a chunk of C tokens a masked (C, C) product, across chunks the state carried
forward, so memory is O(C² + d_k·d_v) per head and chunk, never O(T²). z rides along as an extra
value column of ones, so numerator and denominator come out of the same products. `scan` runs T tokens
through the recurrence itself — the same bits as T `recurrent_step`s, however a sequence is split (inference
in bf16, and speculative decoding's state after every prefix: model/numerics.py) — on a CPU with linserve's
kernels one `linear_scan` call (model/kernels/delta_rule.cpp: the same roundings in the same order).

Every tensor here is fp32 (callers cast); states are returned, never mutated in place.
"""

from __future__ import annotations

import torch

from . import kernels, numerics
from .pooled_state import PendingUpdate, PooledState


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


def decay_factors(log_decay: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """γ_h = exp(log γ_h) (H,) in fp32 through `numerics.exp` (the same bits eager and compiled); None: no decay."""
    return None if log_decay is None else numerics.exp(log_decay.to(like.dtype))


def advance(S: torch.Tensor, z: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
            gamma: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token into the state: S ← γ·S + φ(k) vᵀ, z ← γ·z + φ(k), each element with exactly these roundings
    (product, then sum). phi_k (..., dk); v (..., dv); S (..., dk, dv); z (..., dk), leading dims (B, H)."""
    outer = phi_k[..., :, None] * v[..., None, :]  # (B, H, dk, dv)
    if gamma is not None:
        S = S * gamma[:, None, None]  # (B, H, dk, dv)
        z = z * gamma[:, None]  # (B, H, dk)
    return S + outer, z + phi_k


def read_out(phi_q: torch.Tensor, S: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """o = φ(q)ᵀS / (φ(q)ᵀz + eps) with both contractions over d_k as `tree_sum`s (a fixed order).
    phi_q (..., dk); S (..., dk, dv); z (..., dk) → (..., dv)."""
    num = numerics.tree_sum(phi_q[..., :, None] * S, -2)  # (..., dv)
    den = numerics.tree_sum(phi_q * z, -1)  # (...)
    return num / (den[..., None] + eps)


def read_pooled(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, S: PooledState, z: torch.Tensor,
                log_decay: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, PendingUpdate, torch.Tensor]:
    """`recurrent_step` with S read from the rows' pool slots (`linserve::linear_read`: `advance` then `read_out`'s
    numerator, to the bit, S not written): o (B, H, dv), S's update pending (pooled_state.py), z after (B, H, dk)."""
    B, H, dk = phi_q.shape
    gamma = decay_factors(log_decay, phi_q)  # (H,) or None
    alpha = None if gamma is None else gamma[None, :, None].expand(B, H, dk).contiguous()  # (B, H, dk)
    phi_q, phi_k, v = phi_q.contiguous(), phi_k.contiguous(), v.contiguous()
    if S.pending is not None:  # the slots' pending updates applied as they are read
        num = torch.ops.linserve.linear_read_folded(phi_q, phi_k, v, alpha, S.pool, S.slots,
                                                    *S.pending.tensors())  # (B, H, dv)
    else:
        num = torch.ops.linserve.linear_read(phi_q, phi_k, v, alpha, S.pool, S.slots)  # (B, H, dv)
    z = (z if gamma is None else z * gamma[:, None]) + phi_k  # (B, H, dk): advance's z
    den = numerics.tree_sum(phi_q * z, -1)  # (B, H): read_out's
    return num / (den[..., None] + eps), PendingUpdate(S.pool, S.slots, phi_k, v, alpha, S.pending), z


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
    The inputs are never modified; `scan` gives the same bits for every token of a sequence."""
    S, z = advance(S, z, phi_k, v, decay_factors(log_decay, S))  # (B, H, dk, dv), (B, H, dk)
    return read_out(phi_q, S, z, eps), S, z


SCAN_BLOCK = 64  # tokens whose states a scan holds at once: (B, H, 64, dk, dv + 1) fp32, whatever T is


def scan(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    log_decay: torch.Tensor | None,
    eps: float,
    prefixes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T tokens through the recurrence, bit for bit what T `recurrent_step`s give, whatever T and wherever a
    sequence is split: every state element follows its own sequential chain of the same roundings (z rides
    as an extra value column of ones: γ·z + φ(k)·1 is `advance`'s z), and the outputs are read from the
    stored states with `read_out`'s tree sums in one batched pass per block of tokens.

    phi_q, phi_k (B, H, T, dk); v (B, H, T, dv); S (B, H, dk, dv); z (B, H, dk) → o (B, H, T, dv) and the state
    after the T tokens — or, with `prefixes`, the state after every prefix: S (B, T, H, dk, dv), z (B, T, H, dk).
    """
    B, H, T, dk = phi_q.shape
    dv = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, H, 0, dv), S, z
    gamma = decay_factors(log_decay, S)  # (H,) or None
    state = torch.cat([S, z[..., None]], dim=-1)  # (B, H, dk, dv+1)
    if S.device.type == "cpu" and kernels.load():
        return _scan_on_kernel(phi_q, phi_k, v, state, gamma, eps, prefixes)
    decay = None if gamma is None else gamma[:, None, None].expand_as(state)  # (B, H, dk, dv+1)
    keys = phi_k.permute(2, 0, 1, 3)  # (T, B, H, dk): time outermost, so a token's state is one slab
    queries = phi_q.permute(2, 0, 1, 3)  # (T, B, H, dk)
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).permute(2, 0, 1, 3)  # (T, B, H, dv+1)
    outs, blocks = [], []
    for start in range(0, T, SCAN_BLOCK):
        block = keys[start : start + SCAN_BLOCK, ..., None] * values[start : start + SCAN_BLOCK, ..., None, :]
        for slab in block.unbind(0):  # (t, B, H, dk, dv+1) φ(k)vᵀ, in place: each slab becomes its token's state
            slab.add_(state if decay is None else state * decay)  # γ·S + φ(k)vᵀ (+ is commutative)
            state = slab  # (B, H, dk, dv+1)
        ext = numerics.tree_sum(queries[start : start + SCAN_BLOCK, ..., None] * block, -2)  # (t, B, H, dv+1)
        outs.append(ext[..., :dv] / (ext[..., dv:] + eps))  # (t, B, H, dv): read_out's sums and division
        if prefixes:
            blocks.append(block)
    o = (torch.cat(outs) if len(outs) > 1 else outs[0]).permute(1, 2, 0, 3)  # (B, H, T, dv)
    if prefixes:
        every = (torch.cat(blocks) if len(blocks) > 1 else blocks[0]).transpose(0, 1)  # (B, T, H, dk, dv+1)
        return o, every[..., :dv], every[..., dv]
    return o, state[..., :dv].contiguous(), state[..., dv].contiguous()


def _scan_on_kernel(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                    gamma: torch.Tensor | None, eps: float, prefixes: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scan` as one `linserve::linear_scan` call: token by token S' = S·γ + φ(k) ⊗ [v, 1] and [num, den] =
    tree_sum_k(φ(q) ⊙ S') over the state with z as its last value column — each element's product, then sum, and
    the read-out's tree of halves over d_k, as torch's form rounds them. Torch's form, compiled, made every
    token's state a chain of in-place slab updates that Inductor re-evaluated per element (a 32-token prefill
    program 1.5× slower than eager); the kernel keeps a head's state in cache across the tokens. Shapes as
    `scan` (state (B, H, dk, dv+1))."""
    B, H, T, dk = phi_q.shape
    dv = v.shape[-1]
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, dv+1)
    alpha = None if gamma is None else gamma[None, :, None, None].expand(B, H, T, dk).contiguous()  # (B, H, T, dk)
    ext, after = torch.ops.linserve.linear_scan(phi_q, phi_k, values, alpha, state, prefixes)  # (B, H, T, dv+1)
    o = ext[..., :dv] / (ext[..., dv:] + eps)  # (B, H, T, dv): read_out's division
    return o, after[..., :dv].contiguous(), after[..., dv].contiguous()  # (B, [T,] H, dk, dv), (B, [T,] H, dk)
