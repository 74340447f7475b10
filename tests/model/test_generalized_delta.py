"""RWKV-7's recurrence in its two forms computes one function (model/generalized_delta.py): the chunkwise form
equals the token scan from a non-zero state across chunk borders; the scan is the rule written out (decay and
read-back along κ̂, then the write); it gives the same bits wherever a sequence is split, every-prefix states
included."""

from __future__ import annotations

import pytest
import torch

from linserve.model import generalized_delta
from linserve.model.families.rwkv7 import DECAY_BOUND


def inputs(T: int, B: int = 2, H: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    """RWKV-7's shapes of its operands: w in (DECAY_BOUND, 0), a = −κ̂, b = κ̂ ⊙ (in-context rate in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(B, H, T, dk, generator=gen)  # (B, H, T, dk)
    w = DECAY_BOUND * torch.rand(B, H, T, dk, generator=gen)  # (B, H, T, dk)
    k = torch.randn(B, H, T, dk, generator=gen) * 0.5  # (B, H, T, dk)
    v = torch.randn(B, H, T, dv, generator=gen)  # (B, H, T, dv)
    kk = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=gen), dim=-1)  # (B, H, T, dk)
    rate = torch.rand(B, H, T, dk, generator=gen)  # (B, H, T, dk)
    S = torch.randn(B, H, dk, dv, generator=gen) * 0.5  # (B, H, dk, dv)
    return r, w, k, v, -kk, kk * rate, S


@pytest.mark.parametrize("T", [1, 5, 32, 100])
def test_chunked_form_equals_the_scan(T):
    r, w, k, v, a, b, S = inputs(T)
    o_scan, S_scan = generalized_delta.scan(r, w, k, v, a, b, S)
    for chunk in (8, generalized_delta.CHUNK):
        o_chunk, S_chunk = generalized_delta.chunked(r, w, k, v, a, b, S, chunk=chunk)
        torch.testing.assert_close(o_chunk, o_scan, atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(S_chunk, S_scan, atol=3e-5, rtol=1e-4)


def test_one_step_is_the_rule_written_out():
    """S' = diag(e^w) S + b (aᵀS) + k vᵀ, o = S'ᵀ r — in float64, one head at a time."""
    r, w, k, v, a, b, S = inputs(1)
    o, S_after = generalized_delta.scan(r, w, k, v, a, b, S)
    for batch in range(S.shape[0]):
        for head in range(S.shape[1]):
            s = S[batch, head].double()
            def at(t: torch.Tensor, batch: int = batch, head: int = head) -> torch.Tensor:
                return t[batch, head, 0].double()

            want = torch.diag(at(w).exp()) @ s + torch.outer(at(b), at(a) @ s) + torch.outer(at(k), at(v))
            torch.testing.assert_close(S_after[batch, head].double(), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(o[batch, head, 0].double(), want.T @ at(r), atol=1e-5, rtol=1e-5)


def test_the_scan_gives_the_same_bits_at_any_split_and_per_prefix():
    r, w, k, v, a, b, S = inputs(20)
    o_all, S_all = generalized_delta.scan(r, w, k, v, a, b, S)
    o_first, S_mid = generalized_delta.scan(*(t[:, :, :7] for t in (r, w, k, v, a, b)), S)
    o_rest, S_end = generalized_delta.scan(*(t[:, :, 7:] for t in (r, w, k, v, a, b)), S_mid)
    assert torch.equal(torch.cat([o_first, o_rest], dim=2), o_all) and torch.equal(S_end, S_all)
    _, states = generalized_delta.scan(r, w, k, v, a, b, S, prefixes=True)  # (B, T, H, dk, dv)
    assert torch.equal(states[:, 6], S_mid) and torch.equal(states[:, -1], S_all)


def test_a_row_gets_the_same_bits_alone_or_in_a_batch():
    r, w, k, v, a, b, S = inputs(9, B=4)
    o_batch, S_batch = generalized_delta.scan(r, w, k, v, a, b, S)
    o_one, S_one = generalized_delta.scan(*(t[2:3] for t in (r, w, k, v, a, b, S)))
    assert torch.equal(o_batch[2:3], o_one) and torch.equal(S_batch[2:3], S_one)
