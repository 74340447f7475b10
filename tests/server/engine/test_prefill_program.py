"""The prefill program (prefill_program.py): a chunk padded on the right to T tokens keeps the state and logits after
the row's own length — the bits of the model's eager prefill from the same state — and its compiled buckets compute
what the eager program does; an engine prefilling through them gives the tokens of one that never does."""

from __future__ import annotations

import threading

import pytest
import torch

from linserve.model import numerics
from linserve.model.loading import in_dtype
from linserve.server.engine import EngineRequest, SamplingParams
from linserve.server.engine.compile.compiled_decode import DecodeStep
from linserve.server.engine.prefill_program import PIECES, PREFILL_ROWS, fits, prefill_kind
from linserve.server.engine.sampling import SlotSampling
from linserve.server.engine.state_pool import StatePool
from tests.helpers import Collector, assert_slots_balance, prompt, run, server_threads, tokens_of

T = 8
BUILD_WAIT_S = 2400


def exact_model(tiny_model, device):
    """The default configuration's model: bf16 on a CPU (the exact path), fp32 elsewhere."""
    return in_dtype(tiny_model, torch.bfloat16).eval() if device.type == "cpu" else tiny_model


def pool_with_history(model, device, slots=6):
    pool = StatePool(model, slots, device)
    numerics.prepare_tables(device)
    with torch.inference_mode():  # a real history in every slot: each prefilled from its own prompt
        for slot in range(slots):
            _, state = model(torch.tensor([prompt(5 + slot, 300 + slot)], device=device), pool.gather([slot]))
            pool.scatter([slot], state)
    return pool


def eager_prefill(model, pool, slot, ids):
    """The engine's eager prefill of one chunk from the slot's state: (logits (V,) fp32, state tensors)."""
    logits, state = model(torch.tensor([ids], device=pool.device), pool.gather([slot]))
    return logits[0, -1].float(), [t[0] for t in state.tensors().values()]


def assert_same(got, want, device):
    if device.type == "cpu":  # the exact path: bit for bit
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_padded_chunk_keeps_the_state_and_logits_after_its_own_length(tiny_model, device):
    """Rows of lengths 1, 3 and T in one call, padded with different tokens: each row's slot holds what the eager
    prefill of its own tokens gives, and its logits are the eager logits after them."""
    model = exact_model(tiny_model, device)
    pool = pool_with_history(model, device)
    sampling = SlotSampling(pool.num_slots, model.config.vocab_size, device)
    step = DecodeStep(model, pool, sampling, device, "off", max_rows=4, kind=prefill_kind(T))
    slots, lengths = [4, 1, 2], [1, 3, T]
    chunks = [prompt(length, 40 + slot) for slot, length in zip(slots, lengths)]
    want = [eager_prefill(model, pool, slot, ids) for slot, ids in zip(slots, chunks)]
    padded = [ids + [(7 * j + slot) % 1000 for j in range(T - len(ids))] for slot, ids in zip(slots, chunks)]
    (logits,) = step.run([*map(list, zip(*padded)), slots, lengths])  # (the program writes the slots' state)
    for b, (slot, (want_logits, want_state)) in enumerate(zip(slots, want)):
        assert_same(logits[b], want_logits, device)
        for buffer, tensor in zip(pool.buffers.values(), want_state):
            assert_same(buffer[slot], tensor.to(buffer.dtype), device)


def test_the_kind_names_its_io_and_the_state_budget_keeps_large_states_eager(tiny_model):
    kind = prefill_kind(16)
    assert kind.name == "prefill16" and kind.tokens == 16 and kind.io_rows == 18
    with pytest.raises(ValueError):
        prefill_kind(0)
    assert fits(tiny_model, 16, PREFILL_ROWS)

    class Large:  # fla's 340M Gated DeltaNet: 64.5 MiB of state a row
        def state_bytes(self, context_len: int = 0) -> int:
            return 64_500_000

    assert not fits(Large(), 16, PREFILL_ROWS)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_compiled_prefill_program_is_the_eager_one_to_the_bit(tiny_model, device, compile_cache):
    if device.type != "cpu":
        pytest.skip("the prefill program is compiled on CPUs only (prefill_program_tokens)")
    model = exact_model(tiny_model, device)
    pool = pool_with_history(model, device, slots=12)  # (the engine test below builds the same bucket: one build)
    sampling = SlotSampling(pool.num_slots, model.config.vocab_size, device)
    with server_threads(model, device):
        compiled = DecodeStep(model, pool, sampling, device, "on", max_rows=2, cache_dir=compile_cache,
                              autotune=False, kind=prefill_kind(T))
    compiled.sizes = [2]  # one bucket (a build takes a minute or more on 2 cores): one row pads to it
    compiled.start()
    assert compiled.wait_compiled(BUILD_WAIT_S) and compiled.status == "compiled", compiled.status
    with torch.inference_mode():
        for slots, lengths in (([3], [5]), ([0, 5], [T, 2]), ([2, 2], [1, 1])):
            chunks = [prompt(length, 60 + slot) for slot, length in zip(slots, lengths)]
            want = [eager_prefill(model, pool, slot, ids) for slot, ids in zip(slots, chunks)]
            padded = [ids + [0] * (T - len(ids)) for ids in chunks]
            (logits,) = compiled.run([*map(list, zip(*padded)), slots, lengths])
            for b, (slot, (want_logits, want_state)) in enumerate(zip(slots, want)):
                assert torch.equal(logits[b], want_logits)
                for buffer, tensor in zip(pool.buffers.values(), want_state):
                    assert torch.equal(buffer[slot], tensor.to(buffer.dtype))
    compiled.close(wait=True)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_an_engine_prefilling_through_the_program_gives_the_eager_engines_tokens(make_engine, device, compile_cache):
    """Prompts of 3 … 150 tokens (one call, several calls, the eager form past PIECES × T) alone, then all at once
    (chunks of equal length sharing calls, more rows than the bucket): the same tokens and logprobs as an engine
    that prefills eagerly."""
    if device.type != "cpu":
        pytest.skip("the prefill program is compiled on CPUs only (prefill_program_tokens)")
    # (12 slots and decode bucket 1: test_batch_invariance's compiled engine builds the same one — one build a run)
    compiled = make_engine(compile="on", compile_cache_dir=compile_cache, prefill_program_tokens=T,
                           max_prefill_chunk=160, max_batch_tokens=320, num_slots=12)
    compiled.decode_step.sizes = [1]
    prefill = compiled.runner.prefill_step
    assert prefill is not None and prefill.kind.tokens == T
    prefill.sizes = [2]
    assert prefill.wait_compiled(BUILD_WAIT_S) and prefill.status == "compiled", prefill.status
    shown = compiled.describe_decode_step()["prefill"]  # (/version's decode_step)
    assert shown["status"] == "compiled" and 2 in shown["ready"]
    eager = make_engine(num_slots=12, max_prefill_chunk=160, max_batch_tokens=320)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, logprobs=0)
    assert PIECES * T < 150  # (the longest prompt's one chunk runs eagerly)
    prompts = [prompt(n, 700 + n) for n in (3, 8, 13, 32, 70, 150)] + [prompt(13, 900)]
    alone = [run(compiled, ids, params, f"a{i}") for i, ids in enumerate(prompts)]
    assert prefill.calls > 0  # the short prompts went through the program
    want = [run(eager, ids, params, f"e{i}") for i, ids in enumerate(prompts)]
    together = [sink.wait() for sink in [submit(compiled, ids, params, f"t{i}") for i, ids in enumerate(prompts)]]
    for got in (alone, together):
        assert [tokens_of(o) for o in got] == [tokens_of(o) for o in want]
        assert [logprobs(o) for o in got] == [logprobs(o) for o in want]


def submit(engine, ids, params, request_id) -> Collector:
    sink = Collector()
    engine.submit(EngineRequest(request_id, ids, params), sink).result(10)
    return sink


def logprobs(outputs) -> list[float]:
    return [o.logprob.logprob for o in outputs if o.logprob is not None]


class FailingPrefill:
    """The prefill program's eager form standing in for its compiled buckets (`bucket_ready` says ready: the step
    runner sends short chunks through it), whose `fail_at`-th call raises — a fault in the middle of a chunk, after
    earlier calls of the same chunk have written the slot's state."""

    def __init__(self, step: DecodeStep, fail_at: int | None) -> None:
        self.step, self.fail_at, self.calls = step, fail_at, 0
        self.kind, self.sizes = step.kind, step.sizes

    def bucket_ready(self, rows: int) -> int | None:
        return self.step.bucket_size(rows)

    def run(self, io_rows):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected prefill program fault")
        return self.step.run(io_rows)


class RecordingPrefill(FailingPrefill):
    """The eager program standing in for the compiled buckets, each call's lengths recorded; its first call waits
    until `release` is set (the engine thread held inside a step while more requests arrive)."""

    def __init__(self, step: DecodeStep) -> None:
        super().__init__(step, None)
        self.lengths: list[list[int]] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self, io_rows):
        self.entered.set()
        assert self.release.wait(30)
        self.lengths.append(list(io_rows[-1]))
        return super().run(io_rows)


def test_arrivals_of_different_lengths_share_prefill_program_calls(make_engine, device):
    """While a stream decodes, prompts of 3, 8, 5 and 20 tokens arrive together: each whole short prompt, and each
    T-token chunk of the long one, costs its share of a 2-row call, and rows of different lengths ride one call told
    their own lengths — and every request gets the tokens of an engine that prefills eagerly."""
    if device.type != "cpu":
        pytest.skip("the prefill program is compiled on CPUs only (prefill_program_tokens)")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    engine = make_engine(num_slots=6, max_prefill_chunk=64, max_batch_tokens=128, max_prefill_while_decoding=2 * T)
    r = engine.runner
    program = DecodeStep(r.model, r.pool, r.sampling, device, "off", max_rows=PREFILL_ROWS, kind=prefill_kind(T))
    r.prefill_step = recording = RecordingPrefill(program)
    first, sinks = Collector(), [Collector() for _ in range(4)]
    accepted = [engine.submit(EngineRequest("first", prompt(4, 30), SamplingParams(
        max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)), first)]
    assert recording.entered.wait(30)  # the engine thread is inside the first prompt's call
    prompts = [prompt(3, 31), prompt(8, 32), prompt(5, 33), prompt(20, 34)]
    accepted += [engine.submit(EngineRequest(f"t{i}", ids, params), sink)
                 for i, (ids, sink) in enumerate(zip(prompts, sinks))]
    recording.release.set()  # (the engine takes the arrivals in once the step is over)
    for future in accepted:
        future.result(30)
    got = [sink.wait() for sink in sinks]
    first.wait()
    # the first step after: 3 and 8 in one call, then 5 and the long prompt's first T (a budget of 4 shares)
    assert recording.lengths[1:3] == [[3, 8], [5, T]], recording.lengths
    eager = make_engine(num_slots=6, max_prefill_chunk=64, max_batch_tokens=128)
    want = [run(eager, ids, params, f"e{i}") for i, ids in enumerate(prompts)]
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in want]
    assert_slots_balance(engine)


def test_a_prefill_program_call_that_raises_fails_the_turn_and_the_session_continues_as_if_it_never_ran(
        make_engine, device):
    """A session's second turn (20 tokens: three calls of T) fails at its second call, after the first has written
    its row's state: the request ends with an error, the slots balance, and the turn retried gives the tokens of
    an engine where nothing failed (invariant 2: nothing of the failed turn reached the session)."""
    if device.type != "cpu":
        pytest.skip("the prefill program is compiled on CPUs only (prefill_program_tokens)")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=4, ignore_eos=True)
    turns = [prompt(5, 10), prompt(20, 11), prompt(3, 12)]

    def engine_failing_at(fail_at):
        engine = make_engine(num_slots=4, max_prefill_chunk=64, max_batch_tokens=128)
        r = engine.runner
        program = DecodeStep(r.model, r.pool, r.sampling, device, "off", max_rows=PREFILL_ROWS, kind=prefill_kind(T))
        r.prefill_step = FailingPrefill(program, fail_at)
        return engine, engine.sessions.create(None).result(10)

    clean, clean_session = engine_failing_at(None)
    want = [tokens_of(run(clean, ids, params, f"c{i}", session_id=clean_session.id)) for i, ids in enumerate(turns)]
    faulty, session = engine_failing_at(2)
    got = [tokens_of(run(faulty, turns[0], params, "f0", session_id=session.id))]
    failed = run(faulty, turns[1], params, "f1", session_id=session.id)
    assert failed[-1].finish_reason is not None and failed[-1].finish_reason.value == "error", failed[-1]
    assert faulty.runner.prefill_step.calls == 2  # (the fault came mid-chunk, after one call had run)
    assert_slots_balance(faulty)
    got += [tokens_of(run(faulty, ids, params, f"r{i}", session_id=session.id)) for i, ids in enumerate(turns[1:])]
    assert got == want
    assert faulty.runner.prefill_step.calls > 2 and clean.runner.prefill_step.calls > 0
