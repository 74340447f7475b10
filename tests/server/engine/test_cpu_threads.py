"""The intra-op thread count: the CPUs a process may use (affinity, cgroup quota), the default derived from
them, and the engine setting it before its first op."""

from __future__ import annotations

import os

import pytest
import torch

from linserve.server.engine.cpu_threads import (
    KERNEL_THREADS_FROM_ROWS,
    MAX_DEFAULT_PREFILL_THREADS,
    MAX_DEFAULT_THREADS,
    STREAMED_WEIGHT_BYTES,
    affinity_cpus,
    cgroup_cpu_quota,
    default_kernel_threads,
    default_prefill_threads,
    default_threads,
    plan_threads,
    usable_cpus,
    weight_bytes,
)
from linserve.server.engine.types import SamplingParams
from linserve.server.settings import Settings
from tests.helpers import prompt, run, tokens_of


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cgroup_tree(tmp_path, path: str, limits: dict[str, str]):
    """A cgroup v2 hierarchy under tmp_path: `limits` maps a directory (relative) to its cpu.max line."""
    root = tmp_path / "cgroup"
    (root / path.lstrip("/")).mkdir(parents=True)
    for where, line in limits.items():
        (root / where).mkdir(parents=True, exist_ok=True)
        (root / where / "cpu.max").write_text(line + "\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"0::{path}\n")
    return root, self_cgroup


def test_quota_is_the_tightest_along_the_process_path(tmp_path):
    root, me = cgroup_tree(tmp_path, "/kubepods/pod1/ctr", {"kubepods": "400000 100000", "kubepods/pod1": "max 100000",
                                                            "kubepods/pod1/ctr": "150000 100000"})
    assert cgroup_cpu_quota(root, me) == pytest.approx(1.5)
    root, me = cgroup_tree(tmp_path / "b", "/a/b", {"a": "250000 100000"})  # only an ancestor limits it
    assert cgroup_cpu_quota(root, me) == pytest.approx(2.5)


def test_no_quota_anywhere_is_none(tmp_path):
    root, me = cgroup_tree(tmp_path, "/", {"": "max 100000"})
    assert cgroup_cpu_quota(root, me) is None
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent-self") is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, tmp_path / "no-self") == pytest.approx(3.0)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path, tmp_path / "no-self") is None


@pytest.mark.parametrize(("usable", "threads"), [(0.5, 1), (1, 1), (1.9, 1), (2, 1), (3, 2), (4, 3), (5, 4), (64, 4)])
def test_default_leaves_a_cpu_for_the_rest_and_is_capped(usable, threads):
    assert default_threads(usable) == threads
    assert MAX_DEFAULT_THREADS == 4


@pytest.mark.parametrize(("usable", "threads"), [(0.5, 1), (1, 1), (1.9, 1), (2, 2), (3, 3), (4, 4), (64, 4)])
def test_weights_that_stream_from_memory_decode_on_every_cpu(usable, threads):
    assert default_threads(usable, STREAMED_WEIGHT_BYTES) == threads
    assert default_threads(usable, STREAMED_WEIGHT_BYTES - 1) == default_threads(usable)


def test_the_plan_follows_the_model_weights():
    small = plan_threads(None, None, 12 * 2**20)  # the shipped model's bf16 weights
    large = plan_threads(None, None, 620 * 2**20)  # fla's 340M linear_attn
    assert small.threads == default_threads(usable_cpus()) and small.weight_bytes == 12 * 2**20
    assert large.threads == max(1, min(int(usable_cpus()), MAX_DEFAULT_THREADS))
    assert plan_threads(1, None, 620 * 2**20).threads == 1  # a setting wins


def test_weight_bytes_counts_parameters_in_their_dtype():
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    assert weight_bytes(layer) == (64 * 32 + 32) * 2


@pytest.mark.parametrize(("usable", "threads"), [(0.5, 1), (1, 1), (1.9, 1), (2, 2), (3, 3), (8, 8), (64, 8)])
def test_prefill_default_is_every_usable_cpu_capped(usable, threads):
    assert default_prefill_threads(usable) == threads
    assert MAX_DEFAULT_PREFILL_THREADS == 8


@pytest.mark.parametrize(("usable", "threads", "kernel"), [(1, 1, 1), (2, 1, 2), (2, 2, 2), (3, 2, 3), (16, 4, 4),
                                                          (16, 6, 6)])
def test_kernel_default_is_every_usable_cpu_capped_never_below_the_decode_count(usable, threads, kernel):
    assert default_kernel_threads(usable, threads) == kernel


def test_usable_cpus_is_this_process_affinity_at_most():
    assert 0 < usable_cpus() <= affinity_cpus() == len(os.sched_getaffinity(0))


def test_plan_names_its_source(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    chosen = plan_threads(None)
    assert chosen.source == "default" and chosen.threads == default_threads(usable_cpus())
    assert chosen.omp_wait_policy == "passive"
    asked = plan_threads(3)
    assert (asked.threads, asked.source) == (3, "setting")
    assert chosen.prefill_threads == asked.prefill_threads == default_prefill_threads(usable_cpus())
    assert plan_threads(None, 5).prefill_threads == 5
    assert chosen.kernel_threads == default_kernel_threads(usable_cpus(), chosen.threads)
    assert chosen.kernel_from_rows == KERNEL_THREADS_FROM_ROWS > 1  # by default only for wide steps
    asked_kernel = plan_threads(None, kernel_requested=3)
    assert (asked_kernel.kernel_threads, asked_kernel.kernel_from_rows) == (3, 1)  # asked: every compiled step


def engine_thread_count(engine) -> int:
    """OpenMP's count is per thread (each takes torch's process-wide value when it first runs an op): the
    engine thread's own is the one its steps use."""
    return engine.commands.call(torch.get_num_threads).result(timeout=30)


def test_engine_sets_the_count_before_its_first_op(make_engine, restore_threads):
    torch.set_num_threads(default_threads(usable_cpus()) + 1)  # anything but what the engine will choose
    engine = make_engine()
    assert engine_thread_count(engine) == engine.threads.threads == default_threads(usable_cpus())
    assert engine.threads.source == "default"
    engine = make_engine(threads=3)
    assert engine_thread_count(engine) == engine.threads.threads == 3 and engine.threads.source == "setting"


def test_threads_setting_from_env_and_bounds(monkeypatch):
    monkeypatch.setenv("LINSERVE_THREADS", "2")
    assert Settings.load().threads == 2
    monkeypatch.setenv("LINSERVE_THREADS", "0")
    with pytest.raises(ValueError, match="invalid threads"):
        Settings.load()


def test_dtype_defaults_to_auto(monkeypatch):
    monkeypatch.delenv("LINSERVE_DTYPE", raising=False)  # the suite pins float32 (tests/conftest.py)
    assert Settings.load().dtype == "auto"


class ThreadsSeen:
    """Wraps the engine's model (the real one runs): the calling thread's count at every chunked forward."""

    def __init__(self, model) -> None:
        self.model, self.seen = model, []

    def __call__(self, ids, state, **options):
        self.seen.append((ids.shape[1], torch.get_num_threads()))
        return self.model(ids, state, **options)


def test_prefill_runs_on_the_prefill_count_and_decode_on_the_decode_count(make_engine, restore_threads, device):
    if device.type != "cpu":
        pytest.skip("CPU threads: a CUDA engine's prefill runs on the GPU")
    engine = make_engine(threads=1, prefill_threads=3, adapt_threads=False)  # (the plan's counts, as set)
    assert (engine.threads.threads, engine.threads.prefill_threads) == (1, 3)
    spy = engine.runner.model = ThreadsSeen(engine.runner.model)
    outputs = run(engine, prompt(40), SamplingParams(max_tokens=4, temperature=0), "t")
    assert sum(o.token_id is not None for o in outputs) == 4
    assert [length for length, _ in spy.seen] == [16, 16, 8]  # the engine's chunks (max_prefill_chunk 16)
    assert {threads for _, threads in spy.seen} == {3}
    assert engine_thread_count(engine) == 1  # back for the decode steps


class CompiledSeen:
    """Wraps the engine's decode step (the real one runs): says its buckets are compiled (the step runner then
    puts the kernel count in force) and records the calling thread's count at every decode step."""

    def __init__(self, step, compiled: bool) -> None:
        self.step, self.compiled, self.seen = step, compiled, []

    def bucket_ready(self, rows: int) -> int | None:
        return rows if self.compiled else None

    def __call__(self, tokens, slots, positions):
        self.seen.append(torch.get_num_threads())
        return self.step(tokens, slots, positions)


@pytest.mark.parametrize(("compiled", "count"), [(True, 2), (False, 1)])
def test_a_compiled_decode_step_runs_on_the_kernel_count(make_engine, restore_threads, device, compiled, count):
    if device.type != "cpu":
        pytest.skip("CPU threads: a CUDA engine's decode runs on the GPU")
    engine = make_engine(threads=1, kernel_threads=2, adapt_threads=False)
    assert (engine.threads.threads, engine.threads.kernel_threads) == (1, 2)
    spy = engine.runner.decode_step = CompiledSeen(engine.runner.decode_step, compiled)
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=1, ignore_eos=True)
    assert tokens_of(run(engine, prompt(20), params, "t")) == tokens_of(run(make_engine(), prompt(20), params, "u"))
    assert spy.seen and set(spy.seen) == {count}


def in_thread(fn):
    """fn() on a new thread; its result (that thread then waits until the test lets it end: it stays alive)."""
    import threading

    result, release = [], threading.Event()

    def run_it() -> None:
        result.append(fn())
        release.wait(30)

    thread = threading.Thread(target=run_it, daemon=True)
    thread.start()
    while not result:
        thread.join(0.01)
    return result[0], release


def test_one_thread_here_sets_this_threads_count_only(restore_threads):
    """Only the engine thread keeps an OpenMP team: another thread's ops run on it alone, while the process's
    default — what a new thread (the engine's) starts with — stays as it was."""
    from linserve.server.engine.cpu_threads import _openmp_runtime, one_thread_here

    if _openmp_runtime() is None:
        pytest.skip("no OpenMP runtime found in this process's mappings")
    torch.set_num_threads(2)

    def single() -> int:
        one_thread_here()
        torch.ones(1 << 20).exp_()  # (an op big enough to split, were the count above 1)
        return torch.get_num_threads()

    count, release = in_thread(single)
    fresh, release_fresh = in_thread(torch.get_num_threads)
    release.set()
    release_fresh.set()
    assert (count, fresh, torch.get_num_threads()) == (1, 2, 2)


def test_in_passing_thread_returns_raises_and_leaves_no_thread():
    import threading

    from linserve.server.engine.cpu_threads import in_passing_thread

    ran_on = []

    def add(a, b):
        ran_on.append(threading.current_thread())
        return a + b

    def fail():
        ran_on.append(threading.current_thread())
        raise ValueError("bad")

    assert in_passing_thread(add, 2, 3) == 5
    with pytest.raises(ValueError, match="bad"):
        in_passing_thread(fail)
    # each call ran on a thread of its own, not this one, and that thread has ended (other tests' threads may
    # come and go meanwhile: only these two are asserted on)
    assert len(ran_on) == 2 and threading.current_thread() not in ran_on and ran_on[0] is not ran_on[1]
    assert all(thread.name.startswith("linserve-passing") and not thread.is_alive() for thread in ran_on)
