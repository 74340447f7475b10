"""The chunked parallel form and the recurrent form equal a naive quadratic reference."""

from __future__ import annotations

import pytest
import torch

from linserve.model.attention import head_log_decays
from linserve.model.config import ModelConfig
from linserve.model.feature_maps import FeatureMap
from linserve.model.linear_attention import chunked_forward, recurrent_step
from tests.devices import device_under_test

DEVICE = device_under_test()  # `pytest --device cuda` runs these on the GPU

B, H, D = 2, 3, 8
EPS = 1e-6


def naive_reference(phi_q, phi_k, v, log_decay, eps=EPS):
    """Explicit masked φ(Q)φ(K)ᵀ with decay γ^(i-j): O(T²), from the empty state."""
    T = phi_q.shape[2]
    i = torch.arange(T, device=phi_q.device)
    distance = (i[:, None] - i[None, :]).to(phi_q.dtype)  # (T, T)
    mask = (distance >= 0).to(phi_q.dtype)  # (T, T)
    if log_decay is None:
        weights = mask.expand(phi_q.shape[1], T, T)  # (H, T, T)
    else:
        weights = torch.exp(log_decay.to(phi_q.dtype)[:, None, None] * distance.clamp(min=0)) * mask
    scores = (phi_q @ phi_k.transpose(-1, -2)) * weights  # (B, H, T, T)
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)  # (B, H, T, dv)


def reference_state(phi_k, v, log_decay):
    """Final (S, z) from the definition: Σ_j γ^(T-1-j) φ(k_j) v_jᵀ and Σ_j γ^(T-1-j) φ(k_j)."""
    T = phi_k.shape[2]
    if log_decay is None:
        w = torch.ones(phi_k.shape[1], T, dtype=phi_k.dtype, device=phi_k.device)
    else:
        steps = torch.arange(T - 1, -1, -1, dtype=phi_k.dtype, device=phi_k.device)  # (T,)
        w = torch.exp(log_decay.to(phi_k.dtype)[:, None] * steps)
    weighted = phi_k * w[None, :, :, None]  # (B, H, T, dk)
    return weighted.transpose(-1, -2) @ v, weighted.sum(2)


def features(feature_map: str, T: int, dtype: torch.dtype, seed: int = 0):
    config = ModelConfig(n_heads=H, d_model=H * D, feature_map=feature_map, favor_features=12, eps=EPS)
    fmap = FeatureMap(config, layer_index=1)
    g = torch.Generator().manual_seed(seed)
    fmap = fmap.to(DEVICE)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype).to(DEVICE) for _ in range(3))
    phi_q = fmap(q, is_query=True)
    phi_k = fmap(k, is_query=False)
    log_decay = head_log_decays(config).to(DEVICE)
    return phi_q, phi_k, v, log_decay


def empty_state(phi_k, v):
    return phi_k.new_zeros(B, H, phi_k.shape[-1], v.shape[-1]), phi_k.new_zeros(B, H, phi_k.shape[-1])


def recurrent_all(phi_q, phi_k, v, S, z, log_decay):
    outs = []
    for t in range(phi_q.shape[2]):
        o, S, z = recurrent_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], S, z, log_decay, EPS)
        outs.append(o)
    return torch.stack(outs, dim=2), S, z


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("feature_map", ["elu1", "relu", "favor"])
@pytest.mark.parametrize("use_decay", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, 16])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_chunked_and_recurrent_equal_naive(feature_map, use_decay, chunk, dtype, tol):
    for T in sorted({1, max(chunk - 1, 1), chunk, 3 * chunk + 5}):
        phi_q, phi_k, v, log_decay = features(feature_map, T, dtype, seed=T)
        log_decay = log_decay if use_decay else None
        expected = naive_reference(phi_q.double(), phi_k.double(), v.double(), log_decay)
        S_ref, z_ref = reference_state(phi_k.double(), v.double(), log_decay)

        o_chunk, S_chunk, z_chunk = chunked_forward(phi_q, phi_k, v, *empty_state(phi_k, v), log_decay, chunk, EPS)
        o_rec, S_rec, z_rec = recurrent_all(phi_q, phi_k, v, *empty_state(phi_k, v), log_decay)

        for got in (o_chunk, o_rec):
            assert got.dtype == dtype
            assert rel_err(got.double(), expected) < tol, (T, rel_err(got.double(), expected))
        for S, z in ((S_chunk, z_chunk), (S_rec, z_rec)):
            assert rel_err(S.double(), S_ref) < tol
            assert rel_err(z.double(), z_ref) < tol


@pytest.mark.parametrize("feature_map", ["elu1", "relu", "favor"])
@pytest.mark.parametrize("use_decay", [False, True])
def test_prefill_split_anywhere_equals_one_pass(feature_map, use_decay):
    T, chunk = 53, 8
    phi_q, phi_k, v, log_decay = features(feature_map, T, torch.float64, seed=3)
    log_decay = log_decay if use_decay else None
    o_full, S_full, z_full = chunked_forward(phi_q, phi_k, v, *empty_state(phi_k, v), log_decay, chunk, EPS)
    rng = torch.Generator().manual_seed(7)
    for _ in range(5):
        cuts = sorted(torch.randint(1, T, (3,), generator=rng).tolist())
        S, z = empty_state(phi_k, v)
        outs = []
        for a, b in zip([0, *cuts], [*cuts, T]):
            o, S, z = chunked_forward(phi_q[:, :, a:b], phi_k[:, :, a:b], v[:, :, a:b], S, z, log_decay, chunk, EPS)
            outs.append(o)
        assert rel_err(torch.cat(outs, dim=2), o_full) < 1e-10
        assert rel_err(S, S_full) < 1e-10 and rel_err(z, z_full) < 1e-10


def test_empty_input_returns_state_unchanged():
    phi_q, phi_k, v, log_decay = features("elu1", 0, torch.float32)
    S, z = torch.rand(B, H, D, D, device=DEVICE), torch.rand(B, H, D, device=DEVICE)
    o, S2, z2 = chunked_forward(phi_q, phi_k, v, S, z, log_decay, 4, EPS)
    assert o.shape == (B, H, 0, D) and torch.equal(S2, S) and torch.equal(z2, z)


@pytest.mark.parametrize("use_decay", [False, True])
def test_gradcheck_chunked_fp64(use_decay):
    T, chunk = 11, 4
    phi_q, phi_k, v, log_decay = features("elu1", T, torch.float64, seed=5)
    log_decay = log_decay if use_decay else None
    S0, z0 = (torch.rand(B, H, D, D, dtype=torch.float64, device=DEVICE),
              torch.rand(B, H, D, dtype=torch.float64, device=DEVICE))
    inputs = tuple(t.detach().requires_grad_() for t in (phi_q, phi_k, v, S0, z0))

    def fn(q, k, vv, S, z):
        return chunked_forward(q, k, vv, S, z, log_decay, chunk, EPS)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("use_decay", [False, True])
def test_gradients_of_chunked_and_naive_agree(use_decay):
    T = 29
    phi_q, phi_k, v, log_decay = features("favor", T, torch.float64, seed=9)
    log_decay = log_decay if use_decay else None
    target = torch.randn(B, H, T, D, dtype=torch.float64, device=DEVICE)
    grads = []
    for compute in ("chunked", "naive"):
        leaves = [t.detach().requires_grad_() for t in (phi_q, phi_k, v)]
        if compute == "chunked":
            o = chunked_forward(*leaves, *empty_state(phi_k, v), log_decay, 8, EPS)[0]
        else:
            o = naive_reference(*leaves, log_decay)
        ((o - target) ** 2).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for g_chunk, g_naive in zip(*grads):
        assert rel_err(g_chunk, g_naive) < 1e-10
