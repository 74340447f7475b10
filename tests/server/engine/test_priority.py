"""Priority scheduling in the engine: a more urgent request preempts a running one, whose fixed-size state and
sampling row wait on the host and come back — its tokens are exactly those it gets without being preempted
(greedy, and seeded sampling with penalties), and slots balance (invariant 5)."""

from __future__ import annotations

import dataclasses

from linserve.server.engine import EngineRequest, SamplingParams
from tests.helpers import Collector, assert_slots_balance, prompt, run, tokens_of

PRIORITY = {"num_slots": 2, "reserved_slots": 1, "max_n": 1, "scheduling_policy": "priority"}


def test_a_preempted_request_resumes_exactly_where_it_was(make_engine):
    engine = make_engine(**PRIORITY)
    for params in (SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, priority=5),
                   SamplingParams(max_tokens=120, temperature=0.9, seed=7, presence_penalty=0.5,
                                  frequency_penalty=0.3, top_k=50, ignore_eos=True, priority=5)):
        alone = tokens_of(run(engine, prompt(12, 1), params, f"alone-{params.seed}"))
        holder, victim, urgent = Collector(), Collector(), Collector()
        long_holder = dataclasses.replace(params, max_tokens=400, seed=None, temperature=0)
        engine.submit(EngineRequest(f"holder-{params.seed}", prompt(8, 2), long_holder),
                      holder).result(10)
        engine.submit(EngineRequest(f"victim-{params.seed}", prompt(12, 1), params),
                      victim).result(10)
        first = [victim.queue.get(timeout=30) for _ in range(20)]  # it runs: both slots are taken
        before = engine.scheduler.preemptions
        engine.submit(EngineRequest(f"urgent-{params.seed}", prompt(6, 3),
                                    SamplingParams(max_tokens=10, temperature=0, priority=-5)), urgent).result(10)
        urgent_outputs = urgent.wait()
        rest = victim.wait()
        holder.wait()
        assert engine.scheduler.preemptions == before + 1  # the later of the two equals was parked
        assert tokens_of(first + rest) == alone  # its state, penalties and random draws all came back
        assert len(tokens_of(urgent_outputs)) == 10
        assert_slots_balance(engine)


def test_an_aborted_parked_request_leaves_nothing_behind(make_engine):
    engine = make_engine(**PRIORITY)
    slow = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True, priority=5)
    sinks = [Collector(), Collector()]
    for number, sink in enumerate(sinks):
        engine.submit(EngineRequest(f"low-{number}", prompt(8, 2), slow), sink).result(10)
        sink.queue.get(timeout=30)
    urgent = Collector()
    engine.submit(EngineRequest("urgent", prompt(6, 3),
                                SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, priority=-5)),
                  urgent).result(10)
    urgent.queue.get(timeout=30)  # admitted: one of the two is parked now
    assert engine.scheduler.preemptions >= 1
    for number in range(2):
        engine.abort(f"low-{number}")
    urgent.wait()
    for sink in sinks:
        assert sink.wait()[-1].finished
    assert_slots_balance(engine)
    assert engine.slot_accounting().result(10)["slots_in_use"] == 0
