"""The delta rule's two forms compute one function (model/delta_rule.py): the chunkwise WY form equals the
token scan — gated and not, β up to 2 (negative eigenvalues), from a non-zero state, across chunk borders —
and the scan gives the same bits wherever a sequence is split, its every-prefix states included."""

from __future__ import annotations

import pytest
import torch

from linserve.model import delta_rule


def inputs(T: int, gated: bool, beta_max: float = 1.0, B: int = 2, H: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = delta_rule.l2_normalize(torch.randn(B, H, T, dk, generator=gen), False) * dk ** -0.5  # (B, H, T, dk)
    k = delta_rule.l2_normalize(torch.randn(B, H, T, dk, generator=gen), False)  # (B, H, T, dk)
    v = torch.randn(B, H, T, dv, generator=gen)  # (B, H, T, dv)
    beta = torch.rand(B, H, T, generator=gen) * beta_max  # (B, H, T)
    g = -torch.rand(B, H, T, generator=gen) * 0.3 if gated else None  # (B, H, T)
    S = torch.randn(B, H, dk, dv, generator=gen) * 0.5  # (B, H, dk, dv)
    return q, k, v, beta, g, S


@pytest.mark.parametrize("T", [1, 5, 64, 150])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_chunked_form_equals_the_scan(T, gated, beta_max):
    q, k, v, beta, g, S = inputs(T, gated, beta_max)
    o_scan, S_scan = delta_rule.scan(q, k, v, beta, g, S)
    for chunk in (16, delta_rule.CHUNK):
        o_chunk, S_chunk = delta_rule.chunked(q, k, v, beta, g, S, chunk=chunk)
        torch.testing.assert_close(o_chunk, o_scan, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(S_chunk, S_scan, atol=2e-5, rtol=1e-4)


def test_strongly_forgetting_heads_flush_to_zero_not_to_subnormals():
    """Decays far below e^-60 within a chunk: the chunkwise form still equals the scan, and its chunk
    matrices hold no subnormal number (which CPUs multiply ~10× slower)."""
    q, k, v, beta, _, S = inputs(70, False)
    g = torch.full_like(beta, -5.0)  # e^-5 a token: e^-315 across a chunk
    o_scan, S_scan = delta_rule.scan(q, k, v, beta, g, S)
    o_chunk, S_chunk = delta_rule.chunked(q, k, v, beta, g, S)
    torch.testing.assert_close(o_chunk, o_scan, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S_chunk, S_scan, atol=2e-5, rtol=1e-4)
    G = g[:, :, :64].cumsum(-1)
    decay = delta_rule._decay(G[..., :, None] - G[..., None, :])
    tiny = torch.finfo(torch.float32).tiny
    assert not ((decay != 0) & (decay.abs() < tiny)).any()


def test_one_write_replaces_what_a_key_stored():
    """The rule itself: with β = 1 and a unit key, reading that key right after writing gives the value."""
    q, k, v, beta, g, S = inputs(1, False)
    beta = torch.ones_like(beta)
    o, S_after = delta_rule.scan(k, k, v, beta, None, S)
    torch.testing.assert_close(o[:, :, 0], v[:, :, 0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(S_after, S)


@pytest.mark.parametrize("gated", [False, True])
def test_the_scan_is_split_invariant_and_gives_every_prefix(gated):
    q, k, v, beta, g, S = inputs(20, gated)
    o_all, S_all = delta_rule.scan(q, k, v, beta, g, S)
    for split in (1, 7, 19):
        cut = lambda x, a, b: None if x is None else x[:, :, a:b]  # noqa: E731
        o1, S1 = delta_rule.scan(cut(q, 0, split), cut(k, 0, split), cut(v, 0, split), cut(beta, 0, split),
                                 cut(g, 0, split), S)
        o2, S2 = delta_rule.scan(cut(q, split, 20), cut(k, split, 20), cut(v, split, 20), cut(beta, split, 20),
                                 cut(g, split, 20), S1)
        assert torch.equal(torch.cat([o1, o2], dim=2), o_all) and torch.equal(S2, S_all)
    _, states = delta_rule.scan(q, k, v, beta, g, S, prefixes=True)  # (B, T, H, dk, dv)
    assert states.shape == (2, 20, 3, 8, 6) and torch.equal(states[:, -1], S_all)
    _, S_5 = delta_rule.scan(q[:, :, :5], k[:, :, :5], v[:, :, :5], beta[:, :, :5], cut(g, 0, 5), S)
    assert torch.equal(states[:, 4], S_5)


def test_rows_are_computed_alone():
    """Batch invariance of the exact path: a row's bits do not depend on the other rows."""
    q, k, v, beta, g, S = inputs(9, True, B=4)
    o, S_after = delta_rule.scan(q, k, v, beta, g, S)
    o1, S1 = delta_rule.scan(q[2:3], k[2:3], v[2:3], beta[2:3], g[2:3], S[2:3])
    assert torch.equal(o[2:3], o1) and torch.equal(S_after[2:3], S1)
