"""Intra-op threads that yield to a busy host (cpu_contention.py): the counters' arithmetic on written /proc and
cgroup files, a real busy process seen as one CPU held, and an engine that prefills on fewer threads beside it
with the same tokens."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from linserve.server.engine.cpu_contention import FIRST_WINDOW_S, IDLE_GAP_S, CpuContention, ThreadCounts
from linserve.server.engine.cpu_threads import ThreadPlan, affinity_set
from linserve.server.engine.proc_stat import TICKS_PER_S, cpus_busy_seconds, process_seconds
from linserve.server.engine.types import SamplingParams
from tests.helpers import prompt, run, tokens_of

STAT = """cpu  {total} 0 0 0 0 0 0 0 0 0
cpu0 {u0} 5 {s0} {i0} 7 1 2 {st0} 0 0
cpu1 {u1} 0 0 {i1} 0 0 0 0 0 0
cpu2 500 0 0 9000 0 0 0 0 0 0
intr 1 2 3
ctxt 99
"""
SELF_STAT = "4242 (linserve (core) x) S 1 2 3 4 5 6 7 8 9 10 {utime} {stime} 0 0 20 0 3 0 100 1000 50\n"


class Clock:
    """The contention's clock, moved by the test: windows of exactly known length whatever the host's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Host:
    """A /proc (stat, self/stat) and a cgroup v2 directory written by the test, advanced tick by tick."""

    def __init__(self, tmp_path) -> None:
        self.proc, self.cgroup = tmp_path / "proc", tmp_path / "cgroup"
        (self.proc / "self").mkdir(parents=True)
        self.cgroup.mkdir()
        self.cpu0 = dict(u0=100, s0=50, i0=1000, st0=0)
        self.cpu1 = dict(u1=30, i1=2000)
        self.own = dict(utime=10, stime=5)
        self.usage_usec = 0
        self.write()

    def write(self) -> None:
        (self.proc / "stat").write_text(STAT.format(total=0, **self.cpu0, **self.cpu1))
        (self.proc / "self" / "stat").write_text(SELF_STAT.format(**self.own))
        (self.cgroup / "cpu.stat").write_text(f"usage_usec {self.usage_usec}\nuser_usec 0\nsystem_usec 0\n")

    def own_seconds(self) -> float:
        """This process's CPU clock (what `time.process_time` reads in the engine)."""
        return (self.own["utime"] + self.own["stime"]) / TICKS_PER_S

    def advance(self, busy0: int, busy1: int, own: int, cgroup_usec: int = 0, idle: int = 0) -> None:
        """Ticks of busy time on cpu0 (split user/steal), cpu1, this process's own; the cgroup's usage."""
        self.cpu0["u0"] += busy0 - busy0 // 4
        self.cpu0["st0"] += busy0 // 4  # (steal counts as held)
        self.cpu1["u1"] += busy1
        self.cpu0["i0"] += idle
        self.own["utime"] += own
        self.usage_usec += cgroup_usec
        self.write()


def test_the_counters_parse_as_the_kernel_writes_them(tmp_path):
    host = Host(tmp_path)
    text = (host.proc / "stat").read_text()
    # cpu0: user 100 + nice 5 + system 50 + irq 1 + softirq 2 + steal 0 (idle 1000 and iowait 7 are not busy)
    assert cpus_busy_seconds(text, frozenset({0})) == pytest.approx(158 / TICKS_PER_S)
    assert cpus_busy_seconds(text, frozenset({0, 1})) == pytest.approx(188 / TICKS_PER_S)
    assert cpus_busy_seconds(text, frozenset({2})) == pytest.approx(500 / TICKS_PER_S)  # the aggregate line: never
    assert process_seconds((host.proc / "self" / "stat").read_text()) == pytest.approx(15 / TICKS_PER_S)


def test_others_are_the_cpus_time_less_this_processs_per_second_of_the_window(tmp_path):
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                      cpu_clock=host.own_seconds)
    clock.now += 0.4
    assert not contention.update() and contention.others == 0  # no window has passed yet
    clock.now += 0.6
    host.advance(busy0=40, busy1=TICKS_PER_S, own=30)  # others: 10 ticks on cpu0 + a whole second on cpu1
    assert contention.update()
    assert contention.others == pytest.approx((10 + TICKS_PER_S) / TICKS_PER_S, rel=1e-9)  # over 1 s
    assert contention.cap(2) == 1 and contention.cap(8) == 1 and contention.cap(1) == 1  # at least one
    clock.now += 1.0
    host.advance(busy0=50, busy1=0, own=50, idle=50)  # everything busy on the CPUs was this process's
    contention.update()
    assert contention.others == pytest.approx(0, abs=1e-9) and contention.free_cpus() == pytest.approx(2)
    assert contention.cap(2) == 2 and contention.cap(3) == 2
    clock.now += 2.0  # (one slow step: this process busy a third of the window, so not idle)
    host.advance(busy0=60, busy1=TICKS_PER_S, own=60)  # others' one CPU-second over two seconds: half a CPU
    contention.update()
    assert contention.others == pytest.approx(0.5) and contention.cap(2) == 2  # (held past half: 1.5 rounds to 2)
    clock.now += 0.5
    host.advance(busy0=30, busy1=TICKS_PER_S * 3 // 10, own=30)
    contention.update()
    assert contention.cap(2) == 1  # 0.6 of a CPU held: 1.4 free


def test_a_window_the_engine_sat_out_idle_is_no_measurement_and_the_next_one_is_short(tmp_path):
    """Others' CPU while no step ran (a load generator starting, a peer's benchmark in turn) says little of what
    they do beside the next steps: the last busy window's figure stands, and a neighbour busy now is seen a short
    window later."""
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                      cpu_clock=host.own_seconds)
    clock.now += 3.0
    host.advance(busy0=0, busy1=2 * TICKS_PER_S, own=1)  # idle 3 s beside a CPU busy for 2 of them
    assert not contention.update() and contention.others == 0 and contention.cap(2) == 2
    clock.now += 0.06  # steps run; the short window has not passed yet
    assert not contention.update()
    clock.now += 0.06
    host.advance(busy0=12, busy1=12, own=12)  # a neighbour holding cpu1 now: seen after a tenth of a second
    assert contention.update() and contention.others == pytest.approx(1.0) and contention.cap(2) == 1
    clock.now += 0.25
    host.advance(busy0=25, busy1=25, own=25)
    assert not contention.update()  # (the windows are back to their length: a quarter of a second is not one)
    clock.now += 5.0
    host.advance(busy0=0, busy1=0, own=0, idle=500)  # idle again, the host quiet: the busy window's figure stands
    assert not contention.update() and contention.cap(2) == 1
    clock.now += 0.125
    host.advance(busy0=12, busy1=0, own=12, idle=12)
    assert contention.update() and contention.cap(2) == 2


def test_a_pause_after_steps_is_idle_though_the_window_began_while_they_ran(tmp_path):
    """The window since the last read holds the steps before a pause: idleness is judged from the last step on."""
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                               cpu_clock=host.own_seconds)
    for _ in range(4):  # steps on both CPUs for 0.4 s after the read
        clock.now += 0.1
        host.advance(busy0=10, busy1=10, own=20)
        assert not contention.update()
    clock.now += 1.2  # then a pause, a neighbour busy on both CPUs through it
    host.advance(busy0=120, busy1=120, own=0)
    assert not contention.update() and contention.cap(2) == 2  # (the window's own share, 0.5, was the steps')
    clock.now += 0.1
    host.advance(busy0=10, busy1=0, own=10)  # the neighbour gone: what is busy is this process's
    assert contention.update() and contention.others == pytest.approx(0, abs=1e-9) and contention.cap(2) == 2


def test_a_wait_the_engine_says_ends_the_window_however_short_against_it(tmp_path):
    """A pause shorter than the window (the engine blocked 0.3 s between two requests while another process ran a
    burst on both CPUs) ended a window that counted the burst, and the next request's first half second ran on one
    thread. A wait the engine says is no measurement: the busy window's figure stands, and a window starts at the
    next step. A wait shorter than IDLE_GAP_S (the next request of a closed loop) does not end the window."""
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                               cpu_clock=host.own_seconds)
    clock.now += 0.5
    host.advance(busy0=40, busy1=40, own=70)  # steps on both CPUs, the frontend a little beside them
    assert contention.update() and contention.cap(2) == 2
    clock.now += 0.2
    host.advance(busy0=20, busy1=20, own=40)
    assert not contention.update()  # (a fifth of a second into the next window)
    contention.waiting()
    contention.waiting()  # (the engine's loop says it on each pass while it blocks: the first counts)
    clock.now += 0.3
    host.advance(busy0=30, busy1=30, own=0)  # the burst, both CPUs, while the engine waited
    assert not contention.update() and contention.cap(2) == 2  # the window was 0.5 s with the burst in it
    clock.now += 0.1
    host.advance(busy0=9, busy1=9, own=16)  # the next request beside the frontend: 0.2 of a CPU
    assert contention.update() and contention.others == pytest.approx(0.2) and contention.cap(2) == 2
    clock.now += 0.49
    host.advance(busy0=40, busy1=40, own=50)  # a neighbour busy beside the steps now
    contention.waiting()
    clock.now += 0.01  # a closed loop's next request: the wait too short to end the window
    host.advance(busy0=1, busy1=1, own=0)
    assert contention.update() and contention.others == pytest.approx(32 / TICKS_PER_S / 0.5)
    assert contention.cap(2) == 1


def test_the_engine_says_when_it_waits_with_nothing_to_step(make_engine, device):
    """The engine's loop says it blocks with nothing live; its next step starts a short window there."""
    if device.type != "cpu":
        pytest.skip("the CPU threads' contention is a CPU engine's")
    engine = make_engine(threads=1, prefill_threads=2, num_slots=4)
    contention = engine.runner.threads.contention
    assert contention is not None
    run(engine, prompt(12, 40), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "w0")
    deadline = time.monotonic() + 10
    while contention.waiting_since is None:  # (the loop goes back to block once the request has ended)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waited = contention.waiting_since
    time.sleep(2 * IDLE_GAP_S)  # (a wait far shorter than the window)
    run(engine, prompt(12, 41), SamplingParams(max_tokens=1, temperature=0.0), "w1")
    started, due = engine.commands.call(lambda: (contention.last.at, contention.due_s)).result(10)
    assert started >= waited + IDLE_GAP_S and due == FIRST_WINDOW_S


def test_a_busy_window_counts_however_rarely_steps_ask_or_however_little_cpu_this_process_gets(tmp_path):
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                      cpu_clock=host.own_seconds)
    clock.now += 2.0  # one step of 2 s (a long prefill chunk): no step asked, but this process worked
    host.advance(busy0=2 * TICKS_PER_S, busy1=2 * TICKS_PER_S, own=2 * TICKS_PER_S)
    assert contention.update() and contention.others == pytest.approx(1.0)
    for _ in range(10):  # steps every 0.1 s, this process crowded down to a tenth of a CPU by others
        clock.now += 0.1
        host.advance(busy0=TICKS_PER_S // 10, busy1=TICKS_PER_S // 10, own=TICKS_PER_S // 100)
        contention.update()
    assert contention.others == pytest.approx(1.9) and contention.cap(2) == 1


def test_counters_that_cannot_be_read_keep_the_last_window(tmp_path):
    """A step never fails for want of a counter: the last window's figure stands until one can be read again."""
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                      cpu_clock=host.own_seconds)
    clock.now += 1.0
    host.advance(busy0=50, busy1=TICKS_PER_S, own=50)
    assert contention.update() and contention.cap(2) == 1
    (host.proc / "stat").unlink()
    clock.now += 1.0
    assert not contention.update() and contention.cap(2) == 1
    host.advance(busy0=100, busy1=0, own=100, idle=30)
    clock.now += 1.0
    assert contention.update() and contention.cap(2) == 2


def test_a_quota_counts_what_others_in_the_cgroup_use(tmp_path):
    """In a container limited to 1.5 CPUs on a larger host, a busy process in the same container takes quota, not
    a CPU of the mask: the cgroup's usage shows it."""
    host, clock = Host(tmp_path), Clock()
    contention = CpuContention(frozenset({0, 1}), quota=(1.5, host.cgroup), proc=host.proc, window_s=0.5, clock=clock,
                      cpu_clock=host.own_seconds)
    clock.now += 1.0
    host.advance(busy0=30, busy1=0, own=30, cgroup_usec=int(1.3e6))  # the mask's CPUs look busy with this only
    contention.update()
    assert contention.others == pytest.approx(1.0)  # (1.3 s less this process's 0.3 s, over 1 s)
    assert contention.free_cpus() == pytest.approx(0.5) and contention.cap(2) == 1


@pytest.fixture
def busy_loop():
    """A process spinning for as long as the test runs (killed after it)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)  # (started and spinning)
    yield spinner
    spinner.kill()
    spinner.wait()


def test_a_real_busy_process_is_seen_holding_a_cpu(busy_loop):
    contention = CpuContention.here(window_s=0.4)
    assert contention is not None
    deadline = time.monotonic() + 5
    while not contention.update():  # this process stepping (asking often) but nearly idle: the loop has a CPU
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert contention.others > 0.5, contention.others  # (other load only adds to it)
    cpus = len(affinity_set())
    assert contention.cap(cpus) <= cpus - 1 if cpus > 1 else contention.cap(1) == 1


def adapting_counts(host: Host, clock: Clock, threads: int, kernel_threads: int = 1) -> ThreadCounts:
    """An adapting plan's counts (two prefill threads) over the test's /proc and clock."""
    plan = ThreadPlan(threads=threads, usable_cpus=2, source="default", omp_wait_policy="default", prefill_threads=2,
                      kernel_threads=kernel_threads, adaptive=True)
    return ThreadCounts(plan, CpuContention(frozenset({0, 1}), proc=host.proc, window_s=0.5, clock=clock,
                                            cpu_clock=host.own_seconds))


def test_each_phase_runs_on_its_capped_count_and_decode_comes_back(tmp_path):
    host, clock = Host(tmp_path), Clock()
    counts = adapting_counts(host, clock, threads=2)
    before = torch.get_num_threads()
    try:
        counts.decoding()
        assert torch.get_num_threads() == 2
        clock.now += 1.0
        host.advance(busy0=TICKS_PER_S // 2, busy1=TICKS_PER_S, own=TICKS_PER_S // 2)  # a neighbour holds cpu1
        with counts.prefilling():
            assert torch.get_num_threads() == 1 == counts.prefill
        assert torch.get_num_threads() == counts.decode == 1
        clock.now += 1.0
        host.advance(busy0=TICKS_PER_S // 2, busy1=0, own=TICKS_PER_S // 2, idle=20)  # gone
        counts.decoding()
        assert torch.get_num_threads() == 2 and counts.prefill == 2
    finally:
        torch.set_num_threads(before)


def test_a_compiled_step_runs_on_the_kernel_count_an_eager_one_on_the_decode_count(tmp_path):
    host, clock = Host(tmp_path), Clock()
    counts = adapting_counts(host, clock, threads=1, kernel_threads=2)
    before = torch.get_num_threads()
    try:
        counts.decoding(compiled=True)
        assert torch.get_num_threads() == 2
        counts.decoding()
        assert torch.get_num_threads() == 1  # eager: the decode count
        clock.now += 1.0
        host.advance(busy0=TICKS_PER_S // 2, busy1=TICKS_PER_S, own=TICKS_PER_S // 2)  # a neighbour holds cpu1:
        # the kernel count is capped too
        counts.decoding(compiled=True)
        assert torch.get_num_threads() == 1 == counts.kernel
        clock.now += 1.0
        host.advance(busy0=TICKS_PER_S // 2, busy1=0, own=TICKS_PER_S // 2, idle=20)  # gone
        counts.decoding(compiled=True)
        assert torch.get_num_threads() == 2 == counts.kernel
    finally:
        torch.set_num_threads(before)


def test_a_compiled_step_narrower_than_the_plan_s_rows_runs_on_the_decode_count():
    plan = ThreadPlan(threads=1, usable_cpus=2, source="default", omp_wait_policy="default", prefill_threads=2,
                      kernel_threads=2, kernel_from_rows=32)
    counts = ThreadCounts(plan)
    before = torch.get_num_threads()
    try:
        counts.decoding(compiled=True, rows=31)
        assert torch.get_num_threads() == 1  # a narrow step: `threads`
        counts.decoding(compiled=True, rows=32)
        assert torch.get_num_threads() == 2
        counts.decoding(compiled=False, rows=64)
        assert torch.get_num_threads() == 1  # eager: the decode count, however wide
    finally:
        torch.set_num_threads(before)


def test_a_plan_that_does_not_adapt_keeps_its_counts():
    plan = ThreadPlan(threads=1, usable_cpus=2, source="setting", omp_wait_policy="default", prefill_threads=2)
    assert ThreadCounts(plan).contention is None and ThreadCounts(plan).describe() is None


def test_the_counts_in_force_are_described_as_the_contention_caps_them(tmp_path):
    host, clock = Host(tmp_path), Clock()
    counts = adapting_counts(host, clock, threads=1, kernel_threads=2)
    assert counts.describe() == {"decode": 1, "compiled": 2, "prefill": 2, "others_held": 0.0}
    before = torch.get_num_threads()
    try:
        clock.now += 1.0
        host.advance(busy0=TICKS_PER_S // 2, busy1=TICKS_PER_S * 9 // 10, own=TICKS_PER_S // 2)
        counts.decoding(compiled=True)  # a neighbour holds 0.9 of a CPU
    finally:
        torch.set_num_threads(before)
    assert counts.describe() == {"decode": 1, "compiled": 1, "prefill": 1, "others_held": 0.9}


def test_an_adapting_engine_shows_its_counts_with_its_decode_step(make_engine, device):
    if device.type != "cpu":
        pytest.skip("the CPU threads' contention is a CPU engine's")
    engine = make_engine(threads=1, prefill_threads=2, num_slots=4)
    shown = engine.describe_decode_step()["cpu_contention"]
    assert shown == engine.runner.threads.describe() and set(shown) == {"decode", "compiled", "prefill", "others_held"}
    pinned = make_engine(threads=1, prefill_threads=2, adapt_threads=False, num_slots=4)
    assert "cpu_contention" not in pinned.describe_decode_step()


def test_the_engine_prefills_on_fewer_threads_beside_a_busy_process_with_the_same_tokens(make_engine, busy_loop,
                                                                                        device):
    if device.type != "cpu" or len(affinity_set()) != 2:
        pytest.skip("a 2-CPU host (one busy loop holds half of it): CI's and this project's CPU machines")
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    pinned = make_engine(threads=1, prefill_threads=2, adapt_threads=False, num_slots=4)
    want = [tokens_of(run(pinned, prompt(120, 700 + i), params, f"p{i}")) for i in range(3)]
    pinned.stop()
    engine = make_engine(threads=1, prefill_threads=2, num_slots=4)
    counts = engine.runner.threads
    assert counts.contention is not None and counts.prefill == 2  # (no window has passed yet)
    deadline = time.monotonic() + 30
    got = []
    while counts.prefill != 1 and time.monotonic() < deadline:
        got = [tokens_of(run(engine, prompt(120, 700 + i), params, f"a{i}")) for i in range(3)]
        assert got == want  # the same tokens whichever count prefilled them
    assert counts.prefill == 1, counts.contention.others
    assert [tokens_of(run(engine, prompt(120, 700 + i), params, f"b{i}")) for i in range(3)] == want
