"""compile=auto on CPU decides robustly: a margin and more rounds where close, provisional under load and
measured again when quiet, stored once made quietly. Every measurement here is injected (no outcome
depends on how busy the machine is); the programs are the real eager one standing in for compiled builds."""

from __future__ import annotations

import copy
import json
import subprocess
import threading
import time

import pytest
import torch

from linserve.server.engine.compile import verdict as compile_verdict
from linserve.server.engine.compile.bucket_builds import BucketBuilds
from linserve.server.engine.compile.compiled_decode import DecodeStep
from linserve.server.engine.compile.verdict import (
    CALLS_PER_ROUND,
    DECLINE_BELOW,
    LOAD_LIMIT,
    MAX_ROUNDS,
    MIN_ROUNDS,
    Contention,
    Measurement,
    VerdictStore,
    busy_share,
    judge,
    measure,
    readable_pressure,
)
from linserve.server.engine.sampling import SlotSampling
from linserve.server.engine.state_pool import StatePool
from tests.helpers import require_program

CPU = torch.device("cpu")


def quiet(gain: float) -> Measurement:
    return Measurement(gain, gain * 0.98, gain * 1.02, MIN_ROUNDS, 0.01)


def loaded(gain: float) -> Measurement:
    return Measurement(gain, gain * 0.9, gain * 1.1, MAX_ROUNDS, 0.6)


class Injected:
    """A `measure` that returns the given measurements in turn (the last one again when they run out)."""

    def __init__(self, *measurements: Measurement) -> None:
        self.measurements, self.calls = list(measurements), 0

    def __call__(self, eager, compiled, args, hold=None) -> Measurement:
        self.calls += 1
        return self.measurements[min(self.calls, len(self.measurements)) - 1]


def auto_step(model, cache_dir, measure_with: Injected, max_rows: int = 4) -> DecodeStep:
    """compile=auto on CPU whose 'compiled' buckets are the eager program (nothing is really compiled)."""
    model = copy.deepcopy(model).cpu()
    step = DecodeStep(model, StatePool(model, 4, CPU), SlotSampling(4, model.config.vocab_size, CPU), CPU, "auto",
                      max_rows=max_rows, cache_dir=str(cache_dir))
    step.built = []
    step.builds._compiler = lambda: (lambda size: step.built.append(size) or step.eager_program)
    step.builds.measure = measure_with
    step.builds.busy_share = lambda wait, seconds: 0.0  # the machine's load is injected too (no test depends on it)
    return step


def wait_for(condition, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("gain", [1.09, 1.12, 1.0, 0.96])
def test_gains_around_the_old_line_all_serve_compiled(tiny_model, tmp_path, gain):
    """1.09× declined and 1.12× compiled the whole server under the old 1.1× line: now both, and ties, are
    compiled; nothing about them is provisional."""
    step = auto_step(tiny_model, tmp_path, Injected(quiet(gain)))
    step.start()
    assert step.wait_compiled(600)
    assert step.status == "compiled" and step.ready_sizes == [1, 2, 4]
    assert step.verdict.decision == "compiled" and not step.verdict.provisional
    assert step.builds.measure.calls == 1  # measured once, at the first bucket


def test_a_measurably_slower_compiled_step_is_declined_and_the_rest_never_built(tiny_model, tmp_path):
    step = auto_step(tiny_model, tmp_path, Injected(quiet(0.8)))
    step.start()
    assert step.wait_compiled(600) is False
    assert step.status == "declined" and step.ready_sizes == [] and step.built == [1]
    assert step.describe()["verdict"]["decision"] == "declined"


def test_a_quiet_verdict_is_stored_and_the_next_start_uses_it_without_measuring(tiny_model, tmp_path):
    first = auto_step(tiny_model, tmp_path, Injected(quiet(0.8)))
    first.start()
    first.wait_compiled(600)
    stored = json.loads(open(first.builds.verdicts.path(first.verdict.threads)).read())  # (the compile thread)
    assert stored["decision"] == "declined" and stored["measurement"]["gain"] == 0.8

    again = auto_step(tiny_model, tmp_path, Injected(quiet(1.5)))  # would say compiled, were it asked
    again.start()
    again.wait_compiled(600)
    assert again.builds.measure.calls == 0 and again.built == []  # the stored verdict: nothing measured or built
    assert again.status == "declined" and again.verdict.source == "stored" and again.verdict.measurement.gain == 0.8


def test_the_store_keeps_only_quiet_verdicts_per_thread_count(tmp_path):
    store = VerdictStore(str(tmp_path))
    store.save(judge(loaded(1.3), 1, 2))
    assert store.load(2) is None  # made under load: never stored
    store.save(judge(quiet(1.3), 1, 2))
    assert store.load(2).decision == "compiled" and store.load(2).source == "stored"
    assert store.load(1) is None  # another intra-op thread count is another machine, speed-wise
    (tmp_path / "auto-verdict-threads2.json").write_text("{not json")
    assert store.load(2) is None  # unreadable: measure again
    assert VerdictStore(None).load(2) is None


@pytest.mark.parametrize("first, then, final", [(0.8, 1.3, "compiled"), (1.3, 0.8, "declined")])
def test_a_verdict_made_under_load_is_provisional_and_measured_again_when_quiet(tiny_model, tmp_path, first, then,
                                                                                  final):
    step = auto_step(tiny_model, tmp_path, Injected(loaded(first), quiet(then)))
    step.builds.recheck_s = 0.05
    step.start()
    step.wait_compiled(600)
    wait_for(lambda: step.builds.measure.calls == 2 and not step.verdict.provisional and step.status == final)
    step.close()
    assert step.verdict.decision == final and step.status == final
    assert step.ready_sizes == ([1, 2, 4] if final == "compiled" else [])
    assert VerdictStore(step.cache_dir).load(step.verdict.threads).decision == final  # the quiet one is stored


def test_a_recheck_waits_for_an_idle_engine(tiny_model, tmp_path):
    step = auto_step(tiny_model, tmp_path, Injected(quiet(1.3)))
    step.builds.verdict = judge(loaded(1.3), 1, 2)  # made under load at start-up
    step.builds._measured = 1, step.eager_program

    class ServingMeanwhile:  # the engine runs a decode step while the re-check waits
        def wait(self, timeout):
            step.calls += 1
            return False

    step.builds._closed = ServingMeanwhile()
    assert step.builds._recheck() is False and step.builds.measure.calls == 0 and step.verdict.provisional
    step.builds._closed = threading.Event()
    step.builds.recheck_s = 0
    assert step.builds._recheck() is True and step.builds.measure.calls == 1 and not step.verdict.provisional


def test_a_recheck_waits_for_idle_cpus(tiny_model, tmp_path):
    """Another process busy on the CPUs (another server serving): no measurement — it would only add to the
    load and come out provisional again."""
    step = auto_step(tiny_model, tmp_path, Injected(quiet(1.3)))
    step.builds.verdict = judge(loaded(1.3), 1, 2)
    step.builds._measured = 1, step.eager_program
    step.builds.recheck_s = 0
    probed = []
    step.builds.busy_share = lambda wait, seconds: probed.append(seconds) or 0.6
    assert step.builds._recheck() is False and step.builds.measure.calls == 0 and step.verdict.provisional and probed
    step.builds.busy_share = lambda wait, seconds: None  # the machine's load cannot be read: measure as before
    assert step.builds._recheck() is True and step.builds.measure.calls == 1


def test_busy_share_reads_the_machines_cpu_times(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\n")

    def a_second_passes(seconds):  # user +300, system +100, idle +400, iowait +200
        stat.write_text("cpu  400 0 200 1200 200 0 0 0 0 0\n")
        return False

    assert busy_share(a_second_passes, 1.0, str(stat)) == pytest.approx(400 / 1000)
    assert busy_share(lambda seconds: True, 1.0, str(stat)) is None  # stopped while waiting
    assert busy_share(a_second_passes, 1.0, str(tmp_path / "absent")) is None


def test_measuring_while_the_engine_serves_is_provisional(tiny_model, tmp_path):
    step = auto_step(tiny_model, tmp_path, Injected())

    def measure_while_serving(eager, compiled, args, hold=None):
        step.calls += 1  # a served decode step between two rounds
        return quiet(1.3)

    step.builds.measure = measure_while_serving
    assert step.builds._measure_verdict(1, step.eager_program).provisional


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_measure_takes_more_rounds_only_where_the_ratios_straddle_the_line():
    clock = FakeClock()
    held = []

    class Hold:
        def __enter__(self):
            held.append(1)

        def __exit__(self, *exc):
            return None

    def program(cost):
        def run(*args):
            clock.now += cost
        return run

    clear = measure(program(2.0), program(1.0), (), hold=Hold, timer=clock, contention=Contention(()))
    assert clear.rounds == MIN_ROUNDS and clear.gain == pytest.approx(2.0) and len(held) == MIN_ROUNDS

    eager_calls = [0]

    def straddling(*args):  # eager as fast as compiled one round, 0.9× the next: the quartiles straddle the line
        clock.now += 0.9 if (eager_calls[0] // CALLS_PER_ROUND) % 2 else 1.0
        eager_calls[0] += 1

    close = measure(straddling, program(1.0), (), timer=clock, contention=Contention(()))
    assert close.rounds == MAX_ROUNDS and close.low < DECLINE_BELOW <= close.high


def test_contention_reads_the_kernels_pressure_stall_counter(tmp_path):
    psi = tmp_path / "cpu.pressure"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1000\nfull avg10=0.00 avg60=0.00 avg300=0.00 "
                   "total=0\n")
    assert readable_pressure(str(psi)) == 1000 and readable_pressure(str(tmp_path / "absent")) is None
    with Contention((str(tmp_path / "absent"), str(psi))) as stalled:
        psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=900001000\n")  # 900 s stalled: all of it
    assert stalled.share == 1.0 > LOAD_LIMIT
    with Contention((str(psi),)) as waiting_for_nothing:  # off a CPU, but nothing waited for one: PSI decides
        time.sleep(0.05)
    assert waiting_for_nothing.share == 0.0
    without_psi = Contention((str(tmp_path / "absent"),))
    assert without_psi.path is None
    with without_psi:  # no PSI here: the measuring thread's time off a CPU (all of it, asleep)
        time.sleep(0.05)
    assert without_psi.share > 0.5


def test_the_verdict_is_shown_by_version_and_metrics(make_client, monkeypatch, tmp_path):
    """/version and /metrics carry the verdict with its figures; the text passes promtool."""
    monkeypatch.setattr(compile_verdict, "measure", Injected(loaded(1.23)))
    monkeypatch.setattr(BucketBuilds, "_compiler", lambda self: (lambda size: self.step.eager_program))
    client = make_client(compile="auto", device="cpu", compile_cache_dir=str(tmp_path / "compile"))
    step = client.app.state.engine.decode_step
    assert step.wait_compiled(600)
    version = client.get("/version").json()
    verdict = version["decode_step"]["verdict"]
    assert version["device"] == "cpu" and version["torch"] == torch.__version__
    assert verdict["decision"] == "compiled" and verdict["gain"] == 1.23 and verdict["provisional"] is True
    assert verdict["contention"] == 0.6 and verdict["rounds"] == MAX_ROUNDS and verdict["source"] == "measured"
    assert client.get("/ready").json()["decode_step"]["verdict"] == verdict
    text = client.get("/metrics").text
    assert 'linserve_decode_step_info{compile="auto",status="compiled",verdict="compiled"} 1.0' in text
    assert "linserve_decode_compile_gain 1.23" in text
    assert "linserve_decode_compile_verdict_provisional 1.0" in text
    assert "linserve_decode_compile_contention_ratio 0.6" in text
    assert f"linserve_decode_buckets_ready {len(step.sizes)}.0" in text
    assert 'linserve_intra_op_threads{phase="prefill"}' in text and "linserve_cpu_others_held " in text
    promtool = require_program("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
