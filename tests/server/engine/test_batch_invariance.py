"""Same request, same tokens (design invariant 3) in the default configuration — bf16 on a CPU: a request's
tokens do not depend on what else the engine runs, in any bucket, eager or compiled, with or without
speculation, greedy or seeded. (test_engine.py and test_speculative.py run their own comparisons in this
configuration too: prefix hit vs miss, sessions continued vs sent whole, rows beside speculating rows.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from linserve.model import kernels, projection
from linserve.server.engine import EngineRequest, SamplingParams
from tests.helpers import Collector, prompt, run, tokens_of

BUILD_WAIT_S = 900
PROMPTS = [prompt(3 + 17 * i, 500 + i) for i in range(8)]  # 3 … 122 tokens: several prefill chunks each
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
SEEDED_TOP_K = SamplingParams(max_tokens=40, temperature=0.8, seed=7, top_k=20, ignore_eos=True)  # drawn in-program


def together(engine, params: SamplingParams, tag: str) -> list[list]:
    """All eight prompts submitted at once: one batch, prefills sharing steps, buckets changing as rows end."""
    return together_these(engine, PROMPTS, params, tag)


def logprobs_of(outputs) -> list[float]:
    return [o.logprob.logprob for o in outputs if o.logprob is not None]


@pytest.fixture(params=["eager", "compiled", "eager-int8", "compiled-int8"])
def default_engine(request, make_engine, compile_cache, device):
    """The default configuration — and with int8 weights (`quantization: int8`: the same guarantee)."""
    form, _, weights = request.param.partition("-")
    if weights and (device.type != "cpu" or not kernels.load()):
        pytest.skip("int8 weights: linserve's CPU kernel")
    projection.set_weight_format(weights or "bf16")
    try:
        if form == "eager":
            yield make_engine(num_slots=12)
            return
        if device.type != "cpu":
            pytest.skip("compiled buckets on CUDA are CUDA graphs of cuBLAS kernels: not batch-invariant")
        engine = make_engine(num_slots=12, compile="on", compile_cache_dir=compile_cache)
        # 2 … 7 rows pad to 8 (each build takes a minute on 2 cores; int8: one bucket for every batch)
        engine.decode_step.sizes = [8] if weights else [1, 8]
        prefill = engine.runner.prefill_step  # the default's compiled prefill of short chunks: one bucket
        prefill.sizes = [2]
        assert engine.decode_step.wait_compiled(BUILD_WAIT_S) and engine.decode_step.status == "compiled"
        assert prefill.wait_compiled(BUILD_WAIT_S) and prefill.status == "compiled"
        yield engine
        assert prefill.calls > 0  # the prompts' short chunks went through it
    finally:
        projection.set_weight_format("bf16")


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED, SEEDED_TOP_K], ids=["greedy", "seeded", "seeded-top-k"])
def test_alone_together_and_again_give_the_same_tokens(default_engine, params):
    engine = default_engine
    assert next(engine.model.parameters()).dtype == (torch.bfloat16 if engine.device.type == "cpu"
                                                     else torch.float32)
    alone = [run(engine, ids, params, f"alone{i}") for i, ids in enumerate(PROMPTS)]
    first, second = together(engine, params, "a"), together(engine, params, "b")
    for i in range(len(PROMPTS)):
        assert tokens_of(first[i]) == tokens_of(second[i]) == tokens_of(alone[i]), i
        assert logprobs_of(first[i]) == logprobs_of(alone[i]), i  # the same bits, not only the same argmax


@pytest.mark.slow
@pytest.mark.parametrize("params", [dataclasses.replace(GREEDY, logprobs=None), SEEDED], ids=["greedy", "seeded"])
def test_speculation_alone_and_among_others_gives_plain_decodings_tokens(make_engine, params):
    """Verification computes every drafted position as a decode step does — bit for bit — so accepting a
    draft is exactly plain decoding's choice: the same text alone, among plain rows and among speculating ones."""
    looping = (prompt(6, 9) * 8)[:40]  # prompt lookup drafts from it, and the drafts get accepted
    requests = [looping, *PROMPTS[:3]]
    plain = make_engine(num_slots=12)
    want = [tokens_of(run(plain, ids, params, f"p{i}")) for i, ids in enumerate(requests)]
    fast = make_engine(num_slots=12, speculative="ngram")
    fast.speculation.always = True  # verify whenever drafts exist (the cost model is not this test's business)
    assert tokens_of(run(fast, looping, params, "alone")) == want[0]
    assert [tokens_of(outputs) for outputs in together_these(fast, requests, params)] == want
    tried = sum(s.drafted for s in fast.test_stats if hasattr(s, "drafted"))
    kept = sum(s.accepted for s in fast.test_stats if hasattr(s, "accepted"))
    assert tried > 0 and (kept > 0 or params.temperature > 0), (tried, kept)


def together_these(engine, requests: list[list[int]], params: SamplingParams, tag: str = "t") -> list[list]:
    sinks = [Collector() for _ in requests]
    for i, (ids, sink) in enumerate(zip(requests, sinks)):
        engine.submit(EngineRequest(f"{tag}{i}", ids, params), sink).result(10)
    return [sink.wait() for sink in sinks]
