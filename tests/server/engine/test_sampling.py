"""Batched sampling as a pure function: filters, penalties, per-row randomness."""

from __future__ import annotations

import torch

from server.engine.sampling import BatchParams, apply_penalties, sample, token_logprobs
from server.engine.types import SamplingParams

CPU = torch.device("cpu")


def bp(*params: SamplingParams) -> BatchParams:
    return BatchParams.from_params(list(params), CPU)


def test_greedy_rows_take_argmax_whatever_the_uniform():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens = sample(
        logits, bp(SamplingParams(temperature=0), SamplingParams(temperature=0)), torch.tensor([0.99, 0.01])
    )
    assert tokens.tolist() == [1, 0]


def test_inverse_cdf_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]]))
    params = bp(SamplingParams(temperature=1.0))
    picks = [int(sample(logits, params, torch.tensor([u]))) for u in (0.05, 0.15, 0.29, 0.31, 0.99)]
    assert picks == [0, 1, 1, 2, 2]


def test_top_k_top_p_min_p_filter_per_row():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(3, 1)
    params = bp(SamplingParams(top_k=1), SamplingParams(top_p=0.7), SamplingParams(min_p=0.25))
    # u near 1 picks the least likely token that survives each row's filter
    assert sample(logits, params, torch.full((3,), 0.999)).tolist() == [0, 1, 2]


def test_each_row_uses_only_its_own_uniform():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]])).repeat(2, 1)
    params = bp(SamplingParams(), SamplingParams())
    alone = sample(logits[:1], bp(SamplingParams()), torch.tensor([0.6]))
    together = sample(logits, params, torch.tensor([0.6, 0.1]))
    assert int(alone) == int(together[0]) == 2 and int(together[1]) == 0


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    counts = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    seen = torch.tensor([[True, True, True, False]])
    out = apply_penalties(logits, counts, seen, bp(SamplingParams(repetition_penalty=2.0)))
    assert out.tolist() == [[1.0, -4.0, 0.5, 1.0]]
    out = apply_penalties(logits, counts, seen, bp(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)))
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.75 - 0.5, 1.0]]


def test_logprobs_are_of_the_model_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = token_logprobs(logits, torch.tensor([2, 1]), [2, None])
    expected = torch.log_softmax(logits[0], -1)
    assert out[1] is None
    assert abs(out[0].logprob - float(expected[2])) < 1e-6
    assert [t for t, _ in out[0].top] == [2, 1]


def test_penalised_requests_through_the_engine_avoid_repeats(make_engine):
    from server.engine import EngineRequest
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
