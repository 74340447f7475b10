"""linserve's recurrence kernels (model/kernels/delta_rule.cpp, pooled_state.cpp): torch's scans to the bit, a row
alone as among others, every prefix's state; the pooled read-then-commit; their refusals."""

import pytest
import torch

from linserve.model import kernels
from tests.helpers import require_kernel

OP = torch.ops.linserve if kernels.load() else None


@pytest.fixture(autouse=True)
def kernel_built():
    require_kernel()


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dk,dv", [(37, 40), (64, 16), (16, 33), (5, 1030)])
def test_the_delta_scan_is_torchs_scan_to_the_bit_in_any_batch(gated, dk, dv, monkeypatch):
    """kernels/delta_rule.cpp computes `delta_rule.scan`'s operations in its order: the same bits as torch's form
    (the kernel turned off), a row alone the same as among others, every prefix's state too."""
    from linserve.model import delta_rule

    B, H, T = 4, 3, 6
    generator = torch.Generator().manual_seed(dk * dv)
    q, k = torch.randn(B, H, T, dk, generator=generator), torch.randn(B, H, T, dk, generator=generator)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, H, T, dv, generator=generator)
    beta, S = torch.rand(B, H, T, generator=generator), torch.randn(B, H, dk, dv, generator=generator)
    g = -torch.rand(B, H, T, generator=generator) if gated else None
    o, state = delta_rule.scan(q, k, v, beta, g, S, prefixes=True)  # the kernel
    alone_o, alone_state = delta_rule.scan(q[2:3], k[2:3], v[2:3], beta[2:3], None if g is None else g[2:3], S[2:3],
                                           prefixes=True)
    assert torch.equal(alone_o[0], o[2]) and torch.equal(alone_state[0], state[2])
    with monkeypatch.context() as patch:  # torch's own ops
        patch.setitem(kernels._state, "error", "off for the comparison")
        patch.delitem(kernels._state, "library")
        torch_o, torch_state = delta_rule.scan(q, k, v, beta, g, S, prefixes=True)
    assert kernels.load()
    assert torch.equal(o, torch_o) and torch.equal(state, torch_state)


@pytest.mark.parametrize("gate", ["per_key", "per_head_token", "per_head", "none"])
@pytest.mark.parametrize("dk,dv", [(37, 40), (64, 16), (16, 33), (5, 1030)])
def test_the_linear_scan_is_torchs_scan_to_the_bit_in_any_batch(gate, dk, dv, monkeypatch):
    """kernels/delta_rule.cpp's `linear_scan` computes `recurrence.scan`'s operations in its order for every kind
    of decay (GLA's per key, Mamba2's per head and token, RetNet's per head, none): torch's bits (the kernel
    off), a row alone the same as among others, every prefix's state too."""
    from linserve.model import recurrence

    B, H, T = 4, 3, 6
    generator = torch.Generator().manual_seed(dk * dv)
    q, k = torch.randn(B, H, T, dk, generator=generator), torch.randn(B, H, T, dk, generator=generator)
    v, S = torch.randn(B, H, T, dv, generator=generator), torch.randn(B, H, dk, dv, generator=generator)
    shapes = {"per_key": (B, H, T, dk), "per_head_token": (B, H, T, 1), "per_head": (H,), "none": None}
    g = None if shapes[gate] is None else -torch.rand(shapes[gate], generator=generator)
    row = (lambda t: t[2:3]) if g is None or g.dim() > 1 else (lambda t: t)  # noqa: E731 - (H,) has no batch
    o, state = recurrence.scan(q, k, v, g, S, prefixes=True)  # the kernel
    alone_o, alone_state = recurrence.scan(q[2:3], k[2:3], v[2:3], None if g is None else row(g), S[2:3],
                                           prefixes=True)
    assert torch.equal(alone_o[0], o[2]) and torch.equal(alone_state[0], state[2])
    with monkeypatch.context() as patch:  # torch's own ops
        patch.setitem(kernels._state, "error", "off for the comparison")
        patch.delitem(kernels._state, "library")
        torch_o, torch_state = recurrence.scan(q, k, v, g, S, prefixes=True)
    assert kernels.load()
    assert torch.equal(o, torch_o) and torch.equal(state, torch_state)


@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("dk,dv,T", [(32, 32, 33), (37, 40, 5), (5, 1030, 3), (16, 33, 70)])
def test_the_shipped_models_scan_on_the_kernel_is_torchs_to_the_bit(decay, dk, dv, T, monkeypatch):
    """`linear_attention.scan` (the shipped model's prefill in bf16 and its every-prefix states) runs as one
    `linear_scan` call over [S, z] on a CPU: torch's bits (the kernel off) for the outputs, the final state and
    every prefix's — past one 64-token scan block too —, and a row alone the same as among others."""
    from linserve.model import linear_attention

    B, H = 3, 4
    generator = torch.Generator().manual_seed(dk * dv + T)
    phi_q, phi_k = (torch.rand(B, H, T, dk, generator=generator) + 0.01 for _ in range(2))
    v, S = torch.randn(B, H, T, dv, generator=generator), torch.randn(B, H, dk, dv, generator=generator)
    z = torch.rand(B, H, dk, generator=generator) * 3
    log_decay = -torch.rand(H, generator=generator) if decay else None
    assert kernels.load()
    runs = [linear_attention.scan(phi_q, phi_k, v, S, z, log_decay, 1e-6, prefixes) for prefixes in (False, True)]
    alone = linear_attention.scan(phi_q[1:2], phi_k[1:2], v[1:2], S[1:2], z[1:2], log_decay, 1e-6)
    assert all(torch.equal(a[0], b[1]) for a, b in zip(alone, runs[0]))
    with monkeypatch.context() as patch:  # torch's own ops
        patch.setitem(kernels._state, "error", "off for the comparison")
        patch.delitem(kernels._state, "library")
        torch_runs = [linear_attention.scan(phi_q, phi_k, v, S, z, log_decay, 1e-6, prefixes)
                      for prefixes in (False, True)]
    assert kernels.load()
    for ours, theirs in zip(runs, torch_runs):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dk,dv", [(37, 40), (64, 64), (16, 33), (5, 1030)])
def test_rwkv7s_step_is_torchs_scan_to_the_bit_in_any_batch(dk, dv, monkeypatch):
    """kernels/delta_rule.cpp's `dplr_step` computes `generalized_delta.scan`'s operations in its order: torch's
    bits (the kernel off), a row alone the same as among others, every prefix's state too."""
    from linserve.model import generalized_delta

    B, H, T = 4, 3, 6
    generator = torch.Generator().manual_seed(dk * dv)
    r, k = torch.randn(B, H, T, dk, generator=generator), torch.randn(B, H, T, dk, generator=generator)
    w = -0.6 * torch.rand(B, H, T, dk, generator=generator)
    kk = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=generator), dim=-1)
    a, b = -kk, kk * torch.rand(B, H, T, dk, generator=generator)
    v, S = torch.randn(B, H, T, dv, generator=generator), torch.randn(B, H, dk, dv, generator=generator)
    o, state = generalized_delta.scan(r, w, k, v, a, b, S, prefixes=True)  # the kernel
    alone_o, alone_state = generalized_delta.scan(*(t[2:3] for t in (r, w, k, v, a, b, S)), prefixes=True)
    assert torch.equal(alone_o[0], o[2]) and torch.equal(alone_state[0], state[2])
    with monkeypatch.context() as patch:  # torch's own ops
        patch.setitem(kernels._state, "error", "off for the comparison")
        patch.delitem(kernels._state, "library")
        torch_o, torch_state = generalized_delta.scan(r, w, k, v, a, b, S, prefixes=True)
    assert kernels.load()
    assert torch.equal(o, torch_o) and torch.equal(state, torch_state)


@pytest.mark.parametrize("rule", ["per_key", "per_head_token", "per_head", "none", "delta", "gated_delta"])
@pytest.mark.parametrize("dk, dv", [(37, 40), (6, 33), (12, 150), (24, 40), (256, 24)])
def test_reading_from_the_pool_then_committing_is_the_scan_to_the_bit(rule, dk, dv):
    """kernels/pooled_state.cpp: one token read from the rows' pool slots gives the scan's outputs (recurrence.scan
    or delta_rule.scan over the gathered rows), and the commit leaves in each kept row's slot the scan's state, to
    the bit; a row not kept leaves its slot as it was, a slot repeated (a bucket's padding) is updated once, and
    no other slot is touched. The reads fold the tree's first level into the products (an odd d_k's last row moved
    as the tree moves it: 37; even ones: 6, 12), and its first three where 8 divides d_k (24: three rows left, the
    next level odd; 256: 340M Gated DeltaNet's and linear_attn's)."""
    from linserve.model import delta_rule, recurrence
    from linserve.model.pooled_state import PendingUpdate, PooledState

    B, H, N = 4, 3, 6
    generator = torch.Generator().manual_seed(len(rule) + dk)
    pool = torch.randn(N, H, dk, dv, generator=generator)
    slots = torch.tensor([4, 1, 4, 2])  # row 2 repeats row 0's slot and inputs, as padding does
    q, k, v = (torch.randn(B, H, 1, d, generator=generator) for d in (dk, dk, dv))
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(B, H, 1, generator=generator)
    shapes = {"per_key": (B, H, 1, dk), "per_head_token": (B, H, 1, 1), "per_head": (H,), "gated_delta": (B, H, 1)}
    g = -torch.rand(shapes[rule], generator=generator) if rule in shapes else None
    for t in (q, k, v, beta) + (() if g is None or g.dim() == 1 else (g,)):
        t[2] = t[0]
    delta = rule.endswith("delta")

    def step(S):
        if delta:
            return delta_rule.run(q, k, v, beta, g, S, exact=True)
        return recurrence.run(q, k, v, g, S, exact=True)

    want_o, want_S = step(pool[slots])  # (B, H, 1, dv), (B, H, dk, dv): the scan over gathered rows
    o, update = step(PooledState(pool, slots))
    assert isinstance(update, PendingUpdate) and torch.equal(o, want_o)
    before = pool.clone()
    keep = torch.tensor([True, True, True, False])
    assert torch.equal(update.commit(keep), keep)
    assert torch.equal(pool[4], want_S[0]) and torch.equal(pool[1], want_S[1])
    assert torch.equal(pool[2], before[2]) and torch.equal(pool[[0, 3, 5]], before[[0, 3, 5]])


@pytest.mark.parametrize("rule", ["gated_delta", "delta", "per_key", "per_head_token", "per_head", "none", "mixed"])
@pytest.mark.parametrize("dk, dv", [(37, 40), (6, 33), (24, 40), (256, 24)])
def test_the_commit_folded_into_the_next_read_is_the_scan_step_after_step(rule, dk, dv):
    """The folded form (kernels/pooled_state.cpp: delta_read_folded / linear_read_folded apply each slot's pending
    update as they read the slot and store the result; pending_record notes the kept rows' updates): over 4 steps
    of rows on the pool — a repeated slot (padding), a row not kept in one step, a slot that joins late — every
    output is the scan's over the states the rows should have, to the bit, and a settled pool holds those states:
    the fused first pass where 8 divides d_k (24, 256), the separate one elsewhere (37, 6). The delta rule's gate is
    per head; the linear recurrence's per key dimension, per head and token, per head, none — or, `mixed`, per key
    dimension and none in turn, so a pending update meets a read of the other kind both ways."""
    from linserve.model import delta_rule, recurrence
    from linserve.model.pooled_state import PendingBuffers, PendingUpdate, PooledState

    B, H, N = 4, 3, 6
    generator = torch.Generator().manual_seed(dk + dv + len(rule))
    pool = torch.randn(N, H, dk, dv, generator=generator)
    states = pool.clone()  # what each slot's state should be (the scan's, slot by slot)
    pending = PendingBuffers(torch.zeros(N, H, dk), torch.zeros(N, H, dv), torch.zeros(N, H, dk),
                             torch.zeros(N, dtype=torch.uint8))
    delta = rule.endswith("delta")
    shapes = {"per_key": (B, H, 1, dk), "per_head_token": (B, H, 1, 1), "per_head": (H,), "gated_delta": (B, H, 1),
              "mixed": (B, H, 1, dk)}
    plans = [([4, 1, 4, 2], [True, True, True, True]), ([4, 1, 4, 2], [True, False, True, True]),
             ([1, 3, 2, 4], [True, True, True, True]), ([2, 4, 2, 1], [True, True, True, True])]
    for step, (row_slots, kept) in enumerate(plans):
        slots, keep = torch.tensor(row_slots), torch.tensor(kept)
        q, k, v = (torch.randn(B, H, 1, d, generator=generator) for d in (dk, dk, dv))
        k = k / k.norm(dim=-1, keepdim=True)
        beta = torch.rand(B, H, 1, generator=generator)
        gated = rule in shapes and not (rule == "mixed" and step % 2)
        g = -torch.rand(shapes[rule], generator=generator) if gated else None
        for t in (q, k, v, beta) + (() if g is None or g.dim() == 1 else (g,)):  # a repeated slot: its first's inputs
            for b in range(B):
                t[b] = t[row_slots.index(row_slots[b])]
        inputs = (q, k, v, beta, g) if delta else (q, k, v, g)
        run = delta_rule.run if delta else recurrence.run
        want_o, want_S = run(*inputs, states[slots], exact=True)  # the scan over the states
        o, update = run(*inputs, PooledState(pool, slots, pending), exact=True)
        assert isinstance(update, PendingUpdate) and torch.equal(o, want_o), step
        assert torch.equal(update.commit(keep), keep)
        for b in range(B):
            if kept[b] and row_slots.index(row_slots[b]) == b:
                states[row_slots[b]] = want_S[b]
    settled = pool.clone()
    flagged = torch.nonzero(pending.flag).flatten()
    for kind in (1, 2):
        index = flagged[pending.flag[flagged] == kind]
        if index.numel():
            torch.ops.linserve.state_commit(settled, index, pending.k[index], pending.u[index],
                                            pending.alpha[index] if kind == 2 else None,
                                            torch.ones(index.numel(), dtype=torch.bool))
    assert torch.equal(settled, states)
    assert set(torch.nonzero(pending.flag).flatten().tolist()) == {1, 2, 3, 4}  # kept since last read: pending
    assert torch.equal(pool[[0, 5]], states[[0, 5]])  # slots no row read: never touched


def test_the_pooled_ops_refuse_what_they_cannot_compute_with_a_message():
    pool, q = torch.zeros(3, 1, 8, 4), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="slot 3 is outside the pool of 3"):
        OP.linear_read(q, q, torch.zeros(2, 1, 4), None, pool, torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        OP.linear_read(q, q, torch.zeros(2, 1, 4), None, pool.transpose(2, 3), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="keep must be bool"):
        OP.state_commit(pool, torch.tensor([0, 1]), q, torch.zeros(2, 1, 4), None, torch.ones(2))
    with pytest.raises(RuntimeError, match="beta must be fp32"):
        OP.delta_read(q, q, torch.zeros(2, 1, 4), torch.zeros(2), None, pool, torch.tensor([0, 1]))


def test_the_delta_scan_refuses_mismatched_shapes_with_a_message():
    S = torch.zeros(2, 1, 8, 4)
    with pytest.raises(RuntimeError, match="q, k must be \\(B, H, T, dk\\)"):
        OP.delta_scan(torch.zeros(2, 1, 3, 7), torch.zeros(2, 1, 3, 7), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3),
                      None, S, False)
    with pytest.raises(RuntimeError, match="beta must be \\(B, H, T\\)"):
        OP.delta_scan(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1),
                      None, S, False)
    with pytest.raises(RuntimeError, match="fp32"):
        OP.delta_scan(*(t.double() for t in (torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 4),
                                              torch.zeros(2, 1, 3))), None, S, False)
