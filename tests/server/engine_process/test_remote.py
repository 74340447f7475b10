"""RemoteEngine against a real engine core process (no HTTP): a core whose engine thread dies sends its
requests' error outputs and then the word, and the frontend's side fails what is pending, runs on_death and
refuses new work; a stop drains the core and ends its process. (The HTTP side of the same: test_e2e_engine_process.)"""

from __future__ import annotations

import time

import pytest

from linserve.server.engine import EngineError, EngineRequest, FinishReason, SamplingParams
from linserve.server.engine.types import StepStats
from linserve.server.engine_process import core_main
from linserve.server.engine_process.remote import start_core
from linserve.server.settings import Settings
from tests.helpers import Collector, prompt

pytestmark = pytest.mark.slow


def core_whose_steps_fail(settings, conn) -> None:
    """The engine core, with every model step raising (spawned: runs in the child)."""
    from linserve.server.engine import step_runner

    def broken(*args, **kwargs):
        raise RuntimeError("injected step failure")

    step_runner.StepRunner.decode = step_runner.StepRunner.prefill = broken
    core_main.run(settings, conn)


def settings_for(checkpoint) -> Settings:
    return Settings(model=str(checkpoint), device="cpu", compile="off", session_store="none", num_slots=4,
                    log_level="warning")


def test_a_dying_core_fails_its_requests_runs_on_death_and_refuses_more(tiny_checkpoint):
    stats = []
    engine, _, _ = start_core(settings_for(tiny_checkpoint), stats.append, target=core_whose_steps_fail)
    deaths = []
    engine.on_death.append(deaths.append)
    try:
        sinks = [Collector() for _ in range(3)]
        for i, sink in enumerate(sinks):  # MAX_CONSECUTIVE_STEP_FAILURES steps fail: the engine thread dies
            engine.submit(EngineRequest(f"r{i}", prompt(6, i), SamplingParams(max_tokens=4)), sink).result(30)
            last = sink.wait(timeout=30)[-1]
            assert last.finish_reason is FinishReason.ERROR and last.error
        deadline = time.monotonic() + 30
        while not deaths:  # the core's "dead" word reached the frontend
            assert time.monotonic() < deadline, "the frontend never heard that the engine died"
            time.sleep(0.05)
        assert not engine.alive
        with pytest.raises(EngineError) as refused:
            engine.submit(EngineRequest("late", prompt(6), SamplingParams(max_tokens=4)), Collector()).result(10)
        assert refused.value.kind == "dead"
        assert engine.store_status() is None  # questions get no answer from a dead core, and do not hang
    finally:
        engine.stop(timeout=30)
    assert not engine.process.is_alive()


def test_a_stopped_core_drains_and_its_stats_reached_the_frontend(tiny_checkpoint):
    stats = []
    engine, tokenizer, _ = start_core(settings_for(tiny_checkpoint), stats.append)
    try:
        sink = Collector()
        engine.submit(EngineRequest("long", prompt(6), SamplingParams(max_tokens=100_000, ignore_eos=True)),
                      sink).result(30)
        assert sink.queue.get(timeout=30).token_id is not None
        assert engine.counts().result(10)[0] == 1
        accounting = engine.slot_accounting().result(10)
        assert accounting["slots_in_use"] == 1  # the running row's slot, as the core counts it
    finally:
        engine.stop(timeout=30)
    outputs = sink.wait(timeout=10)
    assert outputs[-1].finish_reason is FinishReason.ABORT  # the drain ended it
    assert not engine.process.is_alive() and engine.process.exitcode == 0
    assert any(isinstance(item, StepStats) for item in stats)


def test_an_output_crosses_the_channel_whole():
    """RequestOutput pickles as its fields in order (its __reduce__): every field, set and unset, comes back."""
    import dataclasses
    import pickle

    from linserve.server.engine.types import RequestOutput, TokenLogprob

    full = RequestOutput("cmpl-1", 2, 17, " ab", TokenLogprob(17, -0.5, ((17, -0.5), (3, -1.25))),
                         FinishReason.STOP, 5, 9, 14, "sess-1", "why", "store_unavailable",
                         (None, TokenLogprob(4, -2.0)), True)
    assert all(getattr(full, f.name) != f.default for f in dataclasses.fields(full))  # every field set
    for output in (full, RequestOutput("cmpl-2", 0, None, "")):
        assert pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)) == output
