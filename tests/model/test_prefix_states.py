"""Speculative decoding's rollback in the model: one chunked pass over T tokens keeps the state after every
prefix (`forward(prefixes=True)`), each equal to the state token-by-token decoding reaches there (invariant 1)."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_gpt import VARIANTS, build, states_close, tiny

LINEAR = [name for name in VARIANTS if not name.startswith("softmax")]


@pytest.mark.parametrize("name", LINEAR)
@torch.no_grad()
def test_the_state_after_every_prefix_is_the_recurrent_one(name):
    model = build(tiny(**VARIANTS[name]))
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(2)).to(next(model.parameters()).device)
    _, start = model(ids[:, :9])
    logits, prefixes = model(ids[:, 9:], start, prefixes=True)  # (B, 7, V), each tensor (B, 7, …)
    state = start
    for j in range(7):
        step_logits, state = model(ids[:, 9 + j : 10 + j], state)
        torch.testing.assert_close(logits[:, j], step_logits[:, 0], rtol=1e-5, atol=1e-5)
        picked = prefixes.select_prefix(torch.full((3,), j, device=ids.device))
        assert states_close(picked, state, rtol=1e-5), (name, j)
    rows = prefixes.select_prefix(torch.tensor([0, 6, 3], device=ids.device))  # each row its own prefix
    for b, j in enumerate((0, 6, 3)):
        _, alone = model(ids[b : b + 1, : 10 + j])
        assert all(torch.allclose(rows.tensors()[n][b], t[0], rtol=1e-5, atol=1e-5) for n, t in alone.tensors().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_logits_at_one_position_a_row_are_those_of_every_position(dtype):
    """The prefill program's form: the head at each row's own last position only — in bf16 (exact) the bits of
    the whole chunk's logits there, and the state after every prefix unchanged."""
    model = build(tiny(decay=True, conv_kernel=4)).to(dtype)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(4)).to(next(model.parameters()).device)
    at = torch.tensor([11, 0, 6], device=ids.device)
    every, every_state = model(ids, prefixes=True)  # (3, 12, V)
    picked, state = model(ids, prefixes=True, logits_at=at)  # (3, V)
    want = every[torch.arange(3, device=ids.device), at]  # (3, V)
    if dtype == torch.bfloat16 and ids.device.type == "cpu":  # the exact path: the same bits
        assert torch.equal(picked, want)
    else:  # a GEMM over 3 rows against one over 36 (fp32, or bf16 on a GPU): their roundings
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(picked, want, rtol=tolerance, atol=tolerance)
    assert all(torch.equal(state.tensors()[n], t) for n, t in every_state.tensors().items())


def test_softmax_attention_has_no_prefix_states():
    model = build(tiny(attention="softmax"))
    with pytest.raises(ValueError, match="linear-attention"):
        model(torch.zeros(1, 3, dtype=torch.long, device=next(model.parameters()).device), prefixes=True)
