"""RemoteEngine against a real engine core process (no HTTP): a core whose engine thread dies sends its
requests' error outputs and then the word, and the frontend's side fails what is pending, runs on_death and
refuses new work; a stop drains the core and ends its process. (The HTTP side of the same: test_e2e_engine_process.)"""

from __future__ import annotations

import os
import socket
import time

import pytest

from linserve.server.engine import EngineError, EngineRequest, FinishReason, SamplingParams
from linserve.server.engine.types import StepStats
from linserve.server.engine_process import core_main
from linserve.server.engine_process.remote import CoreProcess, connect_core, start_core
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


def test_a_frontend_that_is_gone_has_its_requests_aborted_while_another_serves(tiny_checkpoint):
    """One core, two frontends' connections (as `--api-servers 2` spawns them): both hear every step's stats
    and each other's counted requests; one that ends mid-stream has its request aborted — its slot comes
    back — while the other's goes on; the core ends once the other stops."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=True) for _ in range(2)]
    process = context.Process(target=core_main.run, args=(settings_for(tiny_checkpoint), [t for _, t in pipes]))
    process.start()
    for _, theirs in pipes:
        theirs.close()
    stats, counted = [[], []], [[], []]
    engines = [connect_core(settings_for(tiny_checkpoint), ours, CoreProcess(process.pid), stats[i].append,
                            lambda endpoint, status, i=i: counted[i].append((endpoint, status)))[0]
               for i, (ours, _) in enumerate(pipes)]
    try:
        engines[0].count_request("/v1/completions", "200")
        engines[1].sync()
        engines[0].sync()
        assert counted == [[("/v1/completions", "200")]] * 2  # told to every frontend through the core
        sinks = [Collector(), Collector()]
        for i, engine in enumerate(engines):
            engine.submit(EngineRequest(f"long-{i}", prompt(6, i), SamplingParams(max_tokens=100_000,
                                                                                  ignore_eos=True)),
                          sinks[i]).result(30)
            assert sinks[i].queue.get(timeout=30).token_id is not None
        assert engines[1].slot_accounting().result(10)["slots_in_use"] == 2
        gone = socket.socket(fileno=os.dup(engines[0].conn.fileno()))
        gone.shutdown(socket.SHUT_RDWR)  # the first frontend is gone (as if killed): the core reads its end
        gone.close()
        deadline = time.monotonic() + 30
        while engines[1].counts().result(10)[0] != 1:  # its request was aborted; the other's runs on
            assert time.monotonic() < deadline, "the gone frontend's request still runs"
            time.sleep(0.05)
        accounting = engines[1].slot_accounting().result(10)
        assert accounting["slots_in_use"] == accounting["running_rows"] + accounting["device_sessions"] == 1
        assert all(any(isinstance(item, StepStats) for item in got) for got in stats)  # both heard the steps
    finally:
        engines[1].stop(timeout=30)
    assert sinks[1].wait(timeout=10)[-1].finish_reason is FinishReason.ABORT
    process.join(10)
    assert process.exitcode == 0


def test_a_frontend_loop_reads_the_channel_itself_without_a_reader_thread(tiny_checkpoint):
    """With the frontend's event loop given (as the app does): no reader thread; outputs, answers and stats
    arrive on the loop's own thread; the same tokens as with a reader thread; a question asked on the loop gets
    no answer instead of hanging it; `stop` from a worker thread drains the core through the loop."""
    import asyncio
    import threading

    params = SamplingParams(max_tokens=24, temperature=0.9, seed=11)

    async def main() -> tuple[list[int], set[int], int, object]:
        loop = asyncio.get_running_loop()
        before = {thread.name for thread in threading.enumerate()}
        engine, _, _ = await asyncio.to_thread(start_core, settings_for(tiny_checkpoint), lambda stats: None,
                                               loop=loop)
        try:
            assert "linserve-engine-channel" not in {t.name for t in threading.enumerate()} - before
            threads, tokens, done = set(), [], loop.create_future()

            def sink(output) -> None:
                threads.add(threading.get_ident())
                if output.token_id is not None:
                    tokens.append(output.token_id)
                if output.finished:
                    done.set_result(None)

            await asyncio.wrap_future(engine.submit(EngineRequest("on-loop", prompt(6, 3), params), sink))
            await asyncio.wait_for(done, 60)
            in_use = (await asyncio.wrap_future(engine.slot_accounting()))["slots_in_use"]
            started = time.monotonic()
            unanswered = engine.describe_decode_step()  # on the loop's thread: None at once, not a 10 s hang
            assert time.monotonic() - started < 1
            assert (await asyncio.to_thread(engine.describe_decode_step))["status"] == "eager"  # off it: answered
        finally:
            await asyncio.to_thread(engine.stop, 30)
        return tokens, threads, in_use, (unanswered, engine.process.exitcode)

    tokens, threads, in_use, (unanswered, exitcode) = asyncio.run(main())
    assert threads == {threading.get_ident()} and in_use == 0 and unanswered is None and exitcode == 0
    engine, _, _ = start_core(settings_for(tiny_checkpoint), lambda stats: None)  # a reader thread, as before
    try:
        sink = Collector()
        engine.submit(EngineRequest("in-thread", prompt(6, 3), params), sink).result(30)
        assert [o.token_id for o in sink.wait(timeout=60) if o.token_id is not None] == tokens
    finally:
        engine.stop(timeout=30)


SIGNAL_WHILE_THE_CORE_STARTS = """
import os, signal, sys
from linserve.server.engine_process.remote import spawn_checked

class SignalWhilePickled:  # pickled by Process.start while the child waits for it: the signal comes mid-start
    def __reduce__(self):
        os.kill(os.getpid(), signal.{signal})
        return (dict, ())

ours, process, refused = spawn_checked(SignalWhilePickled())
print(refused, process.pid, process.exitcode, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_while_the_core_is_spawned_kills_it_once_started_without_a_traceback(signum):
    """The signal comes while Process.start writes the child its start (the window `serve` had before its
    handler: it died of SIGTERM there and the child, reading half a start, printed an EOFError's traceback):
    held, then the core is killed once started — status 0 to say so, nothing on stderr, no process left, the
    handler that was there before back in place."""
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_THE_CORE_STARTS.format(signal=signum)],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0 and finished.stderr == "", (finished.returncode, finished.stderr)
    refused, pid, exitcode, default_back = finished.stdout.split()
    assert (refused, exitcode, default_back) == ("0", str(-9), "True")
    assert not os.path.exists(f"/proc/{pid}")  # (killed and reaped: its exit status was read)
