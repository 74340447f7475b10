"""Batched sampling on the device: counter-based uniforms, filters, penalties, logit_bias, per-row parameters."""

from __future__ import annotations

import math

import torch

from linserve.server.engine.sampling import (
    SlotSampling,
    apply_penalties,
    choose_tokens,
    counter_uniforms,
    param_floats,
    sample_filtered,
    sample_plain,
    token_logprobs,
)
from linserve.server.engine.types import SamplingParams

CPU = torch.device("cpu")


def temperatures(*values: float) -> torch.Tensor:
    return torch.tensor(values)


def test_greedy_rows_take_argmax_whatever_the_uniform():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens = sample_plain(logits, temperatures(0, 0), torch.tensor([0.99, 0.01]))
    assert tokens.tolist() == [1, 0]


def test_inverse_cdf_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]]))
    picks = [int(sample_plain(logits, temperatures(1.0), torch.tensor([u]))) for u in (0.05, 0.15, 0.29, 0.31, 0.99)]
    assert picks == [0, 1, 1, 2, 2]


def test_top_k_top_p_min_p_filter_per_row():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(4, 1)
    top_k, top_p, min_p = torch.tensor([1, 0, 0, 0]), torch.tensor([1.0, 0.7, 1.0, 1.0]), torch.tensor([0, 0, 0.25, 0])
    # u near 1 picks the least likely token that survives each row's filter (the last row has none)
    tokens = sample_filtered(logits, temperatures(1, 1, 1, 1), top_k, top_p, min_p, torch.full((4,), 0.999))
    assert tokens.tolist() == [0, 1, 2, 3]


def test_top_k_and_min_p_without_a_sort_drop_exactly_what_the_sorted_form_drops():
    """The path without top-p (no sort: the k-th value, ties broken toward the lower id) against the whole
    sorted distribution, on logits with many ties (rounded to quarters) and every k from 1 past the vocabulary."""
    from linserve.server.engine.sampling import _dropped_by_sort, _outside_top_k, _tempered

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 40, generator=generator) * 4).round() / 4  # (64, 40): ties at every k-th value
    _, probs = _tempered(logits, torch.ones(64))  # (64, 40) float64 (weights: the largest 1)
    for top_k in (1, 2, 3, 7, 20, 39, 40):
        k = torch.full((64,), top_k)
        min_p = torch.rand(64, generator=generator) * torch.tensor([0.0, 0.3]).repeat(32)  # half the rows: none
        fast = _outside_top_k(probs, k) | (probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True))
        assert fast.equal(_dropped_by_sort(probs, k, torch.ones(64), min_p)), top_k
        assert ((~fast).sum(dim=-1) <= top_k).all()
    uniforms = torch.rand(64, generator=generator)
    varied = torch.randint(0, 45, (64,), generator=generator)  # 0: off; past V: nothing dropped
    zeros = torch.zeros(64)
    mixed = sample_filtered(logits, torch.ones(64), varied, torch.ones(64), zeros, uniforms)
    with_top_p = sample_filtered(logits, torch.ones(64), varied, torch.tensor([1.0] * 63 + [0.9999]), zeros, uniforms)
    assert mixed[:63].equal(with_top_p[:63])  # the sorted path (one row asks top-p) draws the same tokens
    smooth = torch.randn(64, 40, generator=generator) * 3  # no ties: the draw over the survivors alone
    uniforms = torch.cat([torch.rand(62, generator=generator), torch.tensor([0.0, 1.0 - 2**-24])])
    min_p = torch.rand(64, generator=generator) * 0.2
    for top_p in (torch.ones(64), torch.tensor([1.0] * 63 + [0.9999])):
        drawn = sample_filtered(smooth, torch.full((64,), 0.7), varied, top_p, min_p, uniforms)
        if top_p[-1] == 1:
            first = drawn
    assert first[:63].equal(drawn[:63])


def test_filtered_sampling_without_filters_is_plain_sampling():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    uniforms = torch.rand(16, generator=torch.Generator().manual_seed(1))
    temperature = torch.linspace(0, 2, 16)
    off = torch.zeros(16, dtype=torch.long)
    plain = sample_plain(logits, temperature, uniforms)
    assert sample_filtered(logits, temperature, off, torch.ones(16), torch.zeros(16), uniforms).equal(plain)


def test_each_row_uses_only_its_own_uniform():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]])).repeat(2, 1)
    alone = sample_plain(logits[:1], temperatures(1), torch.tensor([0.6]))
    together = sample_plain(logits, temperatures(1, 1), torch.tensor([0.6, 0.1]))
    assert int(alone) == int(together[0]) == 2 and int(together[1]) == 0


def test_counter_uniforms_are_a_pure_function_of_seed_and_position():
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 12345])
    positions = torch.tensor([0, 0, 7, 7, 2**32 - 1, 3])
    once = counter_uniforms(seeds, positions)
    assert once.equal(counter_uniforms(seeds, positions))
    # each row alone, and the rows in another order, give the same numbers
    for i in range(len(seeds)):
        assert counter_uniforms(seeds[i : i + 1], positions[i : i + 1]).item() == once[i].item()
    order = torch.randperm(len(seeds))
    assert counter_uniforms(seeds[order], positions[order]).equal(once[order])
    assert len(set(once.tolist())) == len(seeds)  # neighbouring seeds and positions differ


def test_counter_uniforms_are_uniform_and_uncorrelated():
    """200,000 draws over consecutive seeds and positions: each of 64 bins within 5 sigma of its share, and
    the draws of neighbouring positions uncorrelated."""
    seeds = torch.arange(400).repeat_interleave(500)  # (N,)
    positions = torch.arange(500).repeat(400)  # (N,)
    u = counter_uniforms(seeds, positions)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.bincount((u * 64).long(), minlength=64).float()
    expected = len(u) / 64
    assert float((counts - expected).abs().max()) < 5 * math.sqrt(expected)
    grid = u.view(400, 500)
    lag1 = torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]
    seeds_lag = torch.corrcoef(torch.stack([grid[:-1].flatten(), grid[1:].flatten()]))[0, 1]
    assert abs(float(lag1)) < 0.01 and abs(float(seeds_lag)) < 0.01


def test_sampled_tokens_follow_softmax_over_temperature():
    """choose_tokens over many positions draws each token as often as softmax(logits / T) says (chi-square)."""
    vocab, draws, temperature = 8, 40_000, 0.7
    logits = torch.linspace(-2, 2, vocab)
    sampling = SlotSampling(1, vocab, CPU)
    sampling.assign(0, SamplingParams(temperature=temperature), 99, None, [])
    slots = torch.zeros(draws, dtype=torch.long)
    tokens = choose_tokens(logits.repeat(draws, 1), slots, torch.arange(draws), *sampling.tensors())[0]
    observed = torch.bincount(tokens, minlength=vocab).double()
    expected = torch.softmax(logits / temperature, -1).double() * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 30  # 7 degrees of freedom: p ≈ 1e-4


def test_choose_tokens_reads_each_rows_parameters_from_its_slot():
    vocab = 6
    sampling = SlotSampling(4, vocab, CPU)
    sampling.assign(1, SamplingParams(temperature=0), 0, None, [])
    sampling.assign(3, SamplingParams(temperature=0, logit_bias=((5, 100.0),)), 0, None, [])
    sampling.assign(2, SamplingParams(temperature=0, repetition_penalty=1e6), 0, None, [2])  # prompt token 2
    logits = torch.tensor([0.0, 0.0, 5.0, 4.0, 0.0, 0.0]).repeat(3, 1)
    slots, positions = torch.tensor([1, 3, 2]), torch.zeros(3, dtype=torch.long)
    tokens, finite, _, processed, redraw = choose_tokens(logits, slots, positions, *sampling.tensors())
    assert tokens.tolist() == [2, 5, 3] and finite.all() and not redraw.any()  # (greedy rows: no filters apply)
    assert float(processed[1, 5]) == 100.0


def test_the_programs_top_k_draw_is_the_hosts_and_it_flags_what_it_cannot_apply():
    """choose_tokens (inside the decode program) applies top-k up to TOP_K_IN_PROGRAM, with min-p, and draws the
    same token as the host's `sample_filtered` for every row it does not flag — ties at the k-th value included
    (the lower id survives) — and flags top-p, a larger k and min-p alone, never a greedy or unfiltered row."""
    from linserve.server.engine.sampling import TOP_K_IN_PROGRAM

    vocab, rows = 512, 96
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=generator) * 2  # (B, V) no ties
    logits[-8:, :4] = 9.0  # the last rows: the four most likely tokens tie
    sampling = SlotSampling(rows, vocab, CPU)
    cases = []
    for slot in range(rows):
        k = [1, 2, 7, 50, TOP_K_IN_PROGRAM - 1, TOP_K_IN_PROGRAM, 0, TOP_K_IN_PROGRAM + 1][slot % 8]
        min_p = [0.0, 0.02][slot // 8 % 2]
        top_p = 0.9 if slot // 16 % 3 == 2 else 1.0
        temperature = 0.0 if slot // 48 == 1 and slot % 5 == 0 else 0.8
        if slot >= rows - 8:
            k, min_p, top_p, temperature = [2, 3, 4, 5, 1, 2, 3, 4][slot - rows + 8], 0.0, 1.0, 0.8
        params = SamplingParams(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p)
        sampling.assign(slot, params, 1000 + slot, None, [])
        cases.append(params)
    slots, positions = torch.arange(rows), torch.arange(rows) * 3
    tokens, _, uniforms, processed, redraw = choose_tokens(logits, slots, positions, *sampling.tensors())
    host = sample_filtered(processed, sampling.floats[0], sampling.top_k, sampling.floats[1], sampling.floats[2],
                           uniforms)
    greedy = processed.argmax(-1)
    flagged = []
    for b, params in enumerate(cases):
        if params.greedy:
            assert not redraw[b] and tokens[b] == greedy[b], b
        elif not params.uses_filters:
            assert not redraw[b] and tokens[b] == sample_plain(processed[b : b + 1], torch.tensor([0.8]),
                                                                 uniforms[b : b + 1])[0], b
        elif redraw[b]:
            flagged.append(b)
        else:
            assert tokens[b] == host[b], b
    expected = [b for b, params in enumerate(cases) if not params.greedy and params.uses_filters and (
        params.top_p < 1 or params.top_k == 0 or params.top_k > TOP_K_IN_PROGRAM)]
    assert flagged == expected
    tied = [b for b in range(rows - 8, rows) if cases[b].top_k < 4]  # the tie straddles the k-th value
    assert all(not redraw[b] and tokens[b] == host[b] for b in tied)
    from linserve.server.engine.sampling import _dropped_by_sort, _inverse_cdf, _tempered

    _, weights = _tempered(processed[tied], sampling.floats[0, tied])  # the whole sorted distribution's draw
    dropped = _dropped_by_sort(weights, sampling.top_k[tied], torch.ones(len(tied)), torch.zeros(len(tied)))
    assert tokens[tied].equal(_inverse_cdf(weights.masked_fill(dropped, 0.0), uniforms[tied]))
    assert sum(1 for b, params in enumerate(cases) if params.uses_filters and not redraw[b]) > 30  # most drawn here


def test_the_programs_sampling_is_the_same_with_and_without_linserves_kernel(monkeypatch):
    """On a CPU the decode program samples through kernels/sampling.cpp; elsewhere (CUDA, no C++ compiler) through
    torch's ops: the same five outputs to the bit for every kind of row — greedy, unfiltered, top-k with ties,
    min-p, flagged, with logit_bias, repetition/presence/frequency penalties over a prompt and generated counts,
    seeds of every sign and size, rows in any slot order (one slot twice), a row whose logits are not finite."""
    from linserve.model import kernels
    from tests.helpers import require_kernel

    require_kernel()
    vocab, rows = 700, 64
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(rows, vocab, generator=generator) * 8).round() / 4  # (B, V) ties
    logits[7, 3] = float("inf")
    sampling = SlotSampling(rows + 8, vocab, CPU)
    seeds = [77, -1, 2**63 - 100, -(2**63), 2**40 + 5, 0]
    for slot in range(rows):
        penalties = {} if slot % 4 else {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": -0.25}
        params = SamplingParams(temperature=[0.0, 0.7, 1.3][slot % 3], top_k=[0, 1, 5, 40, 64, 65, 0, 3][slot % 8],
                                min_p=[0.0, 0.05][slot // 8 % 2], top_p=[1.0, 1.0, 1.0, 0.8][slot // 16],
                                logit_bias=((5, 3.5), (9, -100.0)) if slot % 5 == 0 else (), **penalties)
        sampling.assign(slot + 8, params, seeds[slot % len(seeds)] + slot, None, [1, 2, 3, slot])
    sampling.record(torch.arange(8, rows + 8).repeat(3), torch.randint(0, vocab, (3 * rows,), generator=generator))
    slots = torch.cat([torch.randperm(rows, generator=generator)[:-1] + 8, torch.tensor([20])])  # slot 20 twice
    positions = torch.arange(rows) * 1000 + 2**33 + 9
    with_kernel = choose_tokens(logits, slots, positions, *sampling.tensors())
    monkeypatch.setattr(kernels, "load", lambda: False)
    without = choose_tokens(logits, slots, positions, *sampling.tensors())
    assert len(with_kernel) == len(without) == 5
    for a, b in zip(with_kernel, without):
        assert a.dtype == b.dtype and a.equal(b)
    assert not with_kernel[1][7] and with_kernel[1].sum() == rows - 1  # (the infinite row flagged)
    assert len(set(with_kernel[0].tolist())) > 16 and with_kernel[4].any()


def test_counts_recorded_by_slot_feed_the_penalties():
    sampling = SlotSampling(2, 4, CPU)
    sampling.assign(0, SamplingParams(frequency_penalty=1.0), 0, None, [])
    sampling.record(torch.tensor([0, 0, 1]), torch.tensor([3, 3, 1]))
    assert sampling.counts[0].tolist() == [0, 0, 0, 2] and sampling.counts[1].tolist() == [0, 1, 0, 0]
    sampling.assign(0, SamplingParams(), 0, None, [])  # a new request in the slot starts from nothing
    assert sampling.counts[0].sum() == 0 and not sampling.seen[0].any()


def test_non_finite_rows_are_flagged_and_sample_anyway():
    sampling = SlotSampling(2, 3, CPU)
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 0.0]])
    _, finite, _, _, _ = choose_tokens(logits, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long),
                                       *sampling.tensors())
    assert finite.tolist() == [False, True]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    counts = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    seen = torch.tensor([[True, True, True, False]])
    out = apply_penalties(logits, counts, seen, [SamplingParams(repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 0.5, 1.0]]
    out = apply_penalties(logits, counts, seen, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.75 - 0.5, 1.0]]
    assert param_floats([SamplingParams()]).shape == (6, 1)


def test_logprobs_are_of_the_model_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = token_logprobs(logits, torch.tensor([2, 1]), [2, None])
    expected = torch.log_softmax(logits[0], -1)
    assert out[1] is None
    assert abs(out[0].logprob - float(expected[2])) < 1e-6
    assert [t for t, _ in out[0].top] == [2, 1]


def test_penalised_requests_through_the_engine_avoid_repeats(make_engine):
    from linserve.server.engine import EngineRequest
    from tests.helpers import Collector, tokens_of

    engine = make_engine()
    prompt = [5, 6, 7, 8]
    plain = Collector()
    engine.submit(EngineRequest("plain", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)), plain)
    penalised = Collector()
    engine.submit(
        EngineRequest(
            "pen",
            prompt,
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
        ),
        penalised,
    )
    plain_tokens, pen_tokens = tokens_of(plain.wait()), tokens_of(penalised.wait())
    assert len(set(pen_tokens)) > len(set(plain_tokens))  # a random tiny model loops greedily; penalties break it
