"""Fault isolation and slot accounting under pressure: a failing step fails only its requests, a dead
engine says so, hostile parameters never reach the thread, and no path leaks a slot."""

from __future__ import annotations

import threading

import pytest

from linserve.server.engine import EngineError, EngineRequest, FinishReason, SamplingParams
from linserve.server.engine.types import SEED_MAX, SEED_MIN
from tests.helpers import GREEDY, Collector, assert_slots_balance, poison_sampling, prompt, run, tokens_of

POISON_TEMPERATURE = 0.777  # the injected sampler fault fires for batches holding a row with this temperature



@pytest.fixture
def poisoned_sampler(monkeypatch):
    """The real step, except that it fails for batches with a poisoned row as many times as armed."""
    return poison_sampling(monkeypatch, POISON_TEMPERATURE, times=0)


def test_a_failing_step_fails_its_request_and_the_engine_goes_on(make_engine, poisoned_sampler):
    engine = make_engine(num_slots=4)
    poisoned_sampler["n"] = 1
    outputs = run(engine, prompt(9), SamplingParams(max_tokens=5, temperature=POISON_TEMPERATURE), "bad")
    assert outputs[-1].finish_reason is FinishReason.ERROR and outputs[-1].error
    assert engine.alive
    good = run(engine, prompt(9), GREEDY, "good")
    assert good[-1].finish_reason is FinishReason.LENGTH and len(tokens_of(good)) == 12
    assert engine.counts().result(10) == (0, 0, 0)
    assert assert_slots_balance(engine)["slots_in_use"] == 0


def test_a_failed_session_turn_leaves_the_session_consistent(make_engine, poisoned_sampler):
    """The step fails after its decode program wrote the rows' state: the session records the pending token as
    consumed (the program's logits predict what follows) — continuing equals the transcript that was emitted."""
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    head = prompt(20, 1)
    run(engine, head, SamplingParams(max_tokens=0), "s0", session_id=session.id)
    sink = Collector()
    poison = SamplingParams(max_tokens=50, temperature=POISON_TEMPERATURE, seed=3, ignore_eos=True)
    engine.submit(EngineRequest("s1", [7, 8], poison, session_id=session.id), sink).result(10)
    first = [sink.queue.get(timeout=10) for _ in range(4)]  # four tokens delivered, then the fault
    poisoned_sampler["n"] = 1
    outputs = first + sink.wait()
    assert outputs[-1].finish_reason is FinishReason.ERROR
    emitted = tokens_of(outputs)
    assert len(emitted) >= 4
    assert engine.sessions.info(session.id, None).result(10).tokens == len(head) + 2 + len(emitted)
    # greedy on the random tiny model repeats one token whatever came before: a draw tells a token consumed
    # twice apart, and the repetition penalty over the session's history one counted but never delivered
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, repetition_penalty=3.0)
    continued = tokens_of(run(engine, [5], sampled, "s2", session_id=session.id))
    assert continued == tokens_of(run(engine, head + [7, 8] + emitted + [5], sampled, "reference"))


def test_an_admission_that_raises_fails_only_that_request(make_engine, monkeypatch):
    engine = make_engine(num_slots=4)
    real = engine.slots.acquire

    def acquire(seq):
        if seq.seq_id == "doomed":
            raise RuntimeError("injected admission fault")
        return real(seq)

    monkeypatch.setattr(engine.slots, "acquire", acquire)
    outputs = run(engine, prompt(5), SamplingParams(max_tokens=3, n=2, temperature=1.0), "doomed")
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR, FinishReason.ERROR]
    assert tokens_of(run(engine, prompt(5), GREEDY, "fine"))
    assert assert_slots_balance(engine)["slots_in_use"] == 0


def test_repeated_failures_kill_the_engine_and_it_says_so(make_engine, monkeypatch):
    engine = make_engine(num_slots=4)
    died = threading.Event()
    engine.on_death.append(lambda error: died.set())
    sink = Collector()
    engine.submit(
        EngineRequest("victim", prompt(6), SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)), sink
    ).result(10)
    sink.queue.get(timeout=10)

    def broken():
        raise RuntimeError("injected: the scheduler's bookkeeping is corrupt")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    assert died.wait(10)
    assert not engine.alive
    assert sink.wait()[-1].finish_reason is FinishReason.ERROR  # the running stream is told, not left hanging
    with pytest.raises(EngineError) as error:
        engine.submit(EngineRequest("late", [1, 2], GREEDY), Collector()).result(5)
    assert error.value.kind == "dead"
    with pytest.raises(EngineError):
        engine.sessions.create(None).result(5)


def test_consecutive_step_failures_end_in_death(make_engine, monkeypatch):
    engine = make_engine(num_slots=4)

    def broken_model(*args, **kwargs):
        raise RuntimeError("injected: the device is gone")

    monkeypatch.setattr(engine.runner, "model", broken_model)
    results = [run(engine, prompt(4, i), GREEDY, f"r{i}")[-1].finish_reason for i in range(3)]
    assert results == [FinishReason.ERROR] * 3
    with pytest.raises(EngineError) as error:
        engine.counts().result(10)
    assert error.value.kind == "dead" and not engine.alive


@pytest.mark.parametrize("seed,n", [(SEED_MAX, 2), (SEED_MIN, 3), (-1, 1), (0, 1)])
def test_extreme_seeds_sample_and_match_their_single_row_twin(make_engine, seed, n):
    engine = make_engine()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, n=n, ignore_eos=True)
    outputs = run(engine, prompt(7), params, f"seed{seed}")
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs if o.finished)
    if n > 1 and seed + 1 <= SEED_MAX:  # row 1 samples with (seed + 1) mod 2**64
        twin = SamplingParams(max_tokens=6, temperature=1.0, seed=seed + 1, ignore_eos=True)
        assert tokens_of(outputs, 1) == tokens_of(run(engine, prompt(7), twin, f"twin{seed}"))


def test_out_of_range_parameters_are_rejected_before_the_engine(make_engine):
    for kwargs, param in [({"seed": 2**70}, "seed"), ({"seed": SEED_MIN - 1}, "seed"), ({"top_k": 2**63}, "top_k")]:
        with pytest.raises(EngineError) as error:
            SamplingParams(**kwargs)
        assert error.value.param == param
    engine = make_engine()
    with pytest.raises(EngineError) as error:
        engine.submit(EngineRequest("k", [1], SamplingParams(top_k=5000)), Collector()).result(10)
    assert error.value.param == "top_k" and "vocabulary" in error.value.message


def test_non_finite_state_fails_its_own_request_only(make_engine):
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    run(engine, prompt(10, 2), SamplingParams(max_tokens=0), "p", session_id=session.id)

    def corrupt():
        slot = engine.registry.by_id[session.id].slot
        for buffer in engine.pool.buffers.values():
            buffer[slot].fill_(float("nan"))

    engine.commands.call(corrupt).result(10)
    bystander = Collector()
    engine.submit(
        EngineRequest("by", prompt(5, 3), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)), bystander
    ).result(10)
    broken = run(engine, [1, 2], GREEDY, "nan", session_id=session.id)
    assert broken[-1].finish_reason is FinishReason.ERROR
    assert bystander.wait()[-1].finish_reason is FinishReason.LENGTH
    assert engine.alive


def test_forking_the_lru_session_with_every_slot_full_leaks_nothing(make_engine):
    engine = make_engine(num_slots=2, max_n=1, reserved_slots=0, max_host_sessions=8)
    a = engine.sessions.create(None).result(10)
    b = engine.sessions.create(None).result(10)
    run(engine, prompt(8, 1), SamplingParams(max_tokens=0), "a0", session_id=a.id)
    run(engine, prompt(8, 2), SamplingParams(max_tokens=0), "b0", session_id=b.id)
    forks = [engine.sessions.fork(a.id, None).result(10), engine.sessions.fork(a.id, None).result(10)]
    assert_slots_balance(engine)
    assert tokens_of(run(engine, [3], GREEDY, "stateless"))  # a slot can still be had
    expected = tokens_of(run(engine, [4, 5], GREEDY, "a1", session_id=a.id))
    for i, fork in enumerate(forks):
        assert tokens_of(run(engine, [4, 5], GREEDY, f"f{i}", session_id=fork.id)) == expected
    assert_slots_balance(engine)


def fill_session_tiers(engine) -> list:
    """Sessions up to the limit of an engine with 4 slots, 1 reserved and room for 2 on the host tier (2 host +
    (4 - 1) device); one more is refused with `capacity`. Returns the five."""
    created = []
    for i in range(5):
        created.append(engine.sessions.create(None).result(10))
        run(engine, prompt(6, i), SamplingParams(max_tokens=0), f"fill{i}", session_id=created[-1].id)
    with pytest.raises(EngineError) as error:
        engine.sessions.create(None).result(10)
    assert error.value.kind == "capacity"
    return created


def test_full_session_tiers_never_starve_stateless_or_host_work(make_engine):
    engine = make_engine(num_slots=4, max_n=1, reserved_slots=1, max_host_sessions=2)
    created = fill_session_tiers(engine)
    assert len(tokens_of(run(engine, prompt(4), GREEDY, "stateless"))) == 12
    tiers = [engine.sessions.info(s.id, None).result(10).tier for s in created]
    assert tiers.count("host") == 2  # host memory is full now: 3 sessions pin device slots, 1 stays free
    assert len(tokens_of(run(engine, prompt(4, 9), GREEDY, "stateless-again"))) == 12
    on_host = [s for s, tier in zip(created, tiers) if tier == "host"]
    for s in on_host:  # a host-tier session comes back by swapping with the least recently used one
        assert len(tokens_of(run(engine, [1], GREEDY, f"back-{s.id}", session_id=s.id))) == 12
    with pytest.raises(EngineError):
        engine.sessions.fork(created[0].id, None).result(10)
    assert_slots_balance(engine)


def test_host_sessions_and_prefix_entries_are_capped_by_their_memory_budgets(make_engine, tiny_model):
    """The counts (max_host_sessions 1,024, prefix_cache_entries 64) are not what binds where states are large:
    budgets of two states' bytes each hold two host sessions and two prefix-cache entries — the full-tiers case
    above, reached through the budget."""
    two_states_mb = 2.5 * tiny_model.config.state_bytes() / 2**20
    engine = make_engine(num_slots=4, max_n=1, reserved_slots=1, max_host_sessions=1024, host_sessions_mb=two_states_mb,
                         prefix_cache_entries=64, prefix_cache_mb=two_states_mb)
    created = fill_session_tiers(engine)
    for i in range(3):  # 48 tokens: two chunk boundaries (16, 32) remembered a prompt, six in all
        assert len(tokens_of(run(engine, prompt(48, 100 + i), GREEDY, f"long{i}"))) == 12
    assert len(engine.prefix_cache) == 2 and engine.prefix_cache.bytes_in_use == 2 * engine.pool.slot_bytes
    assert [engine.sessions.info(s.id, None).result(10).tier for s in created].count("host") == 2
    assert_slots_balance(engine)


def test_a_request_keeps_nothing_that_grows_with_its_length(make_engine):
    """Invariant 4 for a stateless stream: the live request's containers are no bigger at token 1,500 than at 50."""
    engine = make_engine()
    sink = Collector()
    engine.submit(
        EngineRequest(
            "long",
            prompt(5),
            SamplingParams(max_tokens=2_000, temperature=0.8, seed=1, repetition_penalty=1.1, ignore_eos=True),
        ),
        sink,
    ).result(10)

    def footprint() -> int:
        live = engine.live["long"]
        total = 0
        for obj in [live, *live.rows, *(r.detokenizer for r in live.rows), *(r.stop for r in live.rows)]:
            names = getattr(type(obj), "__slots__", None)  # (slots, no __dict__; one unset holds nothing)
            for value in (vars(obj) if names is None else {n: getattr(obj, n, None) for n in names}).values():
                if isinstance(value, (list, tuple, dict, set, str, bytes)):
                    total += len(value)
        return total

    sizes = []
    for mark in (50, 1_500):
        while sink.queue.qsize() < mark:
            threading.Event().wait(0.01)
        sizes.append(engine.commands.call(footprint).result(10))
    engine.abort("long")
    sink.wait()
    # windows (detokenizer ids, held stop text) wobble by a few items; a per-token list would add ~1,450
    assert abs(sizes[1] - sizes[0]) <= 16, sizes


def test_prefix_cache_entries_are_scoped_by_api_key(make_engine):
    """Key B sending key A's prompt gets no hit (no timing side channel across tenants); A does."""
    engine = make_engine(prefix_cache_entries=8)
    shared = prompt(48, 12)
    a = tokens_of(run(engine, shared + [1], GREEDY, "a1", owner="key-a"))
    b = tokens_of(run(engine, shared + [1], GREEDY, "b1", owner="key-b"))
    again = tokens_of(run(engine, shared + [1], GREEDY, "a2", owner="key-a"))
    hits = [s.prefix_cache_hit for s in engine.test_stats if hasattr(s, "prefix_cache_hit")]
    assert hits == [False, False, True]
    assert a == b == again


@pytest.mark.parametrize("failing_output", [3, 8], ids=["mid-stream", "the-last"])
def test_a_sink_that_raises_aborts_only_its_request(make_engine, failing_output):
    """A request's sink raising (a frontend's bug, say) aborts that request — on a token or on its final output —
    and the engine, its slots and the request beside it go on."""
    engine = make_engine(num_slots=4)
    seen = []

    def broken(output):
        seen.append(output)
        if len(seen) == failing_output:
            raise RuntimeError("injected: the sink is broken")

    beside = Collector()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.submit(EngineRequest("beside", prompt(9), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
                  beside).result(10)
    engine.submit(EngineRequest("broken", prompt(9, 2), params), broken).result(10)
    outputs = beside.wait()
    assert outputs[-1].finish_reason is FinishReason.LENGTH and len(tokens_of(outputs)) == 30
    assert engine.alive and engine.counts().result(10) == (0, 0, 0)
    assert len(seen) == failing_output + (failing_output < 8)  # (mid-stream: then its abort's last output)
    assert seen[-1].finished and (failing_output == 8 or seen[-1].finish_reason is FinishReason.ABORT)
    assert assert_slots_balance(engine)["slots_in_use"] == 0
