"""An fla family in the engine, in the default configuration (bf16 on a CPU): a request's tokens do not
depend on its batch (design invariant 3) — alone, all eight together, eager and in compiled buckets — and
speculative decoding gives plain decoding's tokens; every engine test's slot accounting balances (make_engine)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from linserve.model.checkpoint import load_checkpoint
from linserve.server.engine import EngineRequest, step_runner
from tests.helpers import Collector, prompt, run, tokens_of
from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint
from tests.server.engine.test_batch_invariance import BUILD_WAIT_S, GREEDY, PROMPTS, SEEDED, together, together_these

pytestmark = pytest.mark.slow


def model_of(family: str, root, device):
    directory = write_checkpoint(root, {**FAMILY_CASES[family], "vocab_size": 1024})  # the engine tests' 1k tokenizer
    return load_checkpoint(directory, device, torch.float32)


@pytest.fixture(scope="module", params=["gla", "retnet", "delta_net", "gated_deltanet", "hybrid", "mamba2",
                                                     "rwkv7"])
def family_model(request, tmp_path_factory, device):
    return model_of(request.param, tmp_path_factory.mktemp(request.param), device)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_alone_and_together_give_the_same_tokens(make_engine, family_model, params):
    engine = make_engine(family_model, num_slots=12)
    alone = [tokens_of(run(engine, ids, params, f"a{i}")) for i, ids in enumerate(PROMPTS)]
    assert [tokens_of(outputs) for outputs in together(engine, params, "t")] == alone


def test_compiled_buckets_give_the_eager_tokens(make_engine, compile_cache, device, tmp_path):
    """RetNet's programs (its int64 position in the state; GLA's compiled program: test_e2e_families.py)."""
    if device.type != "cpu":
        pytest.skip("compiled buckets on CUDA are CUDA graphs of cuBLAS kernels: not batch-invariant")
    family_model = model_of("retnet", tmp_path, device)
    eager = make_engine(family_model, num_slots=12)
    want = [tokens_of(outputs) for outputs in together(eager, GREEDY, "e")]
    engine = make_engine(family_model, num_slots=12, compile="on", compile_cache_dir=compile_cache)
    engine.decode_step.sizes = [1, 8]
    assert engine.decode_step.wait_compiled(BUILD_WAIT_S) and engine.decode_step.status == "compiled"
    assert [tokens_of(outputs) for outputs in together(engine, GREEDY, "c")] == want
    assert tokens_of(run(engine, PROMPTS[3], GREEDY, "one")) == want[3]


def test_speculation_gives_plain_decodings_tokens(make_engine, family_model):
    """A random model's greedy text falls into a loop within 160 tokens, which prompt lookup then drafts."""
    params = dataclasses.replace(GREEDY, max_tokens=160, logprobs=None)  # (a row asking logprobs never drafts)
    looping = (prompt(6, 9) * 8)[:40]
    plain = make_engine(family_model, num_slots=12)
    want = [tokens_of(run(plain, ids, params, f"p{i}")) for i, ids in enumerate([looping, *PROMPTS[:3]])]
    fast = make_engine(family_model, num_slots=12, speculative="ngram")
    fast.speculation.always = True  # verify whenever drafts exist
    assert [tokens_of(o) for o in together_these(fast, [looping, *PROMPTS[:3]], params)] == want
    assert sum(s.drafted for s in fast.test_stats if hasattr(s, "drafted")) > 0


class RowsPerCall:
    """The engine's model, counting the rows of each eager prefill call (everything else passes through)."""

    def __init__(self, model) -> None:
        self.model, self.rows = model, []

    def __call__(self, ids, state, **options):
        self.rows.append(ids.shape[0])
        return self.model(ids, state, **options)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_rows_whose_state_is_large_prefill_a_few_a_call_with_the_same_tokens(make_engine, device, tmp_path,
                                                                              monkeypatch):
    """Six equal prompts arriving in one step prefill in one eager call; with a budget of two rows' state a call
    (EAGER_PREFILL_STATE_BYTES: fla's 340M states are tens of MB a row) they take three calls — the same tokens."""
    model = model_of("gated_deltanet", tmp_path, device)
    prompts = [prompt(8, 900 + i) for i in range(6)]  # 48 tokens: one step's prefill (max_batch_tokens 64)

    def arriving_together(engine):
        spy = engine.runner.model = RowsPerCall(engine.runner.model)
        gate = threading.Event()
        engine.commands.post(gate.wait)  # the engine thread waits: all six are admitted in one round
        sinks = [Collector() for _ in prompts]
        futures = [engine.submit(EngineRequest(f"r{i}", ids, GREEDY), sink)
                   for i, (ids, sink) in enumerate(zip(prompts, sinks))]
        gate.set()
        for future in futures:
            future.result(10)
        return [tokens_of(sink.wait()) for sink in sinks], spy.rows

    want, rows = arriving_together(make_engine(model, num_slots=8))
    assert rows == [6]
    engine = make_engine(model, num_slots=8)
    monkeypatch.setattr(step_runner, "EAGER_PREFILL_STATE_BYTES", 2 * engine.pool.slot_bytes)
    got, rows = arriving_together(engine)
    assert rows == [2, 2, 2] and got == want
