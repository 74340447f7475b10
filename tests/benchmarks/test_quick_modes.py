"""Every benchmark script runs end to end in its --quick mode and reports its target's fields.

Timing targets are judged by the full runs (README); here only that each measurement works."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.server.settings import Settings
from tests.benchmarks import BENCHMARKS
from tests.devices import device_name_under_test
from tests.helpers import require_kernel, require_program

pytestmark = pytest.mark.slow
ON_ANY_DEVICE = {"decode_vs_context.py", "engine_inprocess.py", "serving_overhead.py", "served_flatness.py",
                 "served_load.py", "serve_startup.py", "served_phases.py"}


COMPILING_S = 1500  # a script that builds buckets: two on 2 cores beside another worker's build took > 300 s in CI


def run(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The script's --quick run, in a session of its own: whatever ends it — its exit, or pytest-timeout's exception
    while it runs — its whole process group (the servers it started) is killed after, so a timed-out benchmark's
    server never holds its port for the tests after it."""
    if script in ON_ANY_DEVICE:
        args = (*args, "--device", device_name_under_test())
    process = subprocess.Popen([sys.executable, str(BENCHMARKS / script), "--quick", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=BENCHMARKS.parent, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_decode_vs_context(tmp_path):
    run("decode_vs_context.py", "--out", str(tmp_path / "p1.json"), "--plot", str(tmp_path / "p1.png"))
    assert (tmp_path / "p1.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "p1.json").read_text())
    assert set(data["decode_step"]) == {"linear", "softmax", "hf_gpt2"}
    assert data["P6"]["bandwidth_gb_s"] > 0 and data["P1"]["ratio"] > 0
    floor = data["P6"]["bandwidth"]  # DRAM over a buffer 4x the last-level cache; the cache case beside it
    assert floor["last_level_cache_bytes"] > 0 and floor["cache_gb_s"] > 0 and data["P6"]["ratio_cache"] > 0


def test_engine_inprocess(tmp_path):
    run("engine_inprocess.py", "--out", str(tmp_path / "e.json"), "--dtype", "float32")
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["P3"]["final_state_max_rel_diff"] < 1e-4  # same final state either way
    assert data["P4"]["tokens_per_s"] and data["P7"]["samples_with"] > 0
    assert all(us > 0 for us in data["P4"]["python_us_per_row"].values())


def test_shipped_scan_against_a_baseline_build(tmp_path):
    """This tree's kernels against a baseline build (here: the same library, by its path): both measured at every
    shape and the prefill, a ratio per round."""
    from linserve.model import kernels

    require_kernel()
    run("shipped_scan.py", "--baseline-library", kernels.library_path()[0], "--out", str(tmp_path / "s.json"))
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data["median"]) == {"this tree", "baseline"}
    assert len(data["median"]["this tree"]) == 4 and all(v > 0 for v in data["median"]["baseline"].values())
    assert all(len(ratios) == 1 and ratios[0] > 0 for ratios in data["speedup_per_round"].values())


def test_one_row_step(tmp_path):
    out = tmp_path / "step.json"
    run("one_row_step.py", "--out", str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["rows"] == 1 and result["steps"] > 0 and 0 < result["p10_ms"] <= result["median_ms"]


def test_engine_host_cost(tmp_path):
    """Both models' engines alive together, every combination measured, and a + b·B through both batch sizes."""
    run("engine_host_cost.py", "--out", str(tmp_path / "h.json"))
    data = json.loads((tmp_path / "h.json").read_text())
    assert set(data["models"]) == {"model", "tiny_twin"}
    assert set(data["runs"]) == {f"{label} flush_mb={mb}" for label in ("model", "tiny_twin") for mb in (0, 8)}
    for run_ in data["runs"].values():
        by_rows = {int(rows): m for rows, m in run_["by_rows"].items()}
        assert set(by_rows) == {1, 4}
        for m in by_rows.values():
            assert m["tokens_per_s"] > 0 and m["program_ms"] > 0 and m["in_step_us_per_row"] > 0
        for part in ("in_step", "loop"):
            line = run_[part]
            for rows, m in by_rows.items():  # the line through both sizes' cost a step
                assert line["a_us_per_step"] + line["b_us_per_row"] * rows == pytest.approx(
                    rows * m[f"{part}_us_per_row"])


def test_serving_overhead(tmp_path):
    run("serving_overhead.py", "--out", str(tmp_path / "p5.json"), "--port", "8791", "--slots", "32",
        "--compile-wait", "0")
    data = json.loads((tmp_path / "p5.json").read_text())
    # the slots asked for (a GPU run shares served_load's compiled buckets) and the engine's programs as measured
    assert data["slots"] == 32 and data["engine_programs"]["buckets"] == [1, 2, 4, 8, 16, 32]
    assert set(data["P5"]) == {"http_api_servers_0", "http_api_servers_1"}  # the engine's two placements, side by side
    for where, p5 in data["P5"].items():
        assert p5["streams_1"]["http_tokens_per_s"] > 0 and p5["streams_32"]["engine_tokens_per_s"] > 0
        assert p5["streams_1"]["engine_python_us_per_row"] > 0  # the Python around the decode program
        parts = data["per_token_1_stream"][where]  # a token's time, part by part (docs/engine.md)
        assert parts["program_ms"] > 0 and parts["engine_token_ms"] > parts["program_ms"]
        assert parts["in_engine"]["ratio"] > 1 and parts["over_http"]["ratio"] > 0
        for load in (p5["streams_1"], p5["streams_32"]):  # the server's counts after each load, as /metrics showed
            assert len(load["served_threads"]) == 1  # (a CPU server adapts its counts by default: it shows them)
            assert all({"decode", "compiled", "prefill", "others_held"} <= set(shown) if data["device"] == "cpu"
                       else shown is None for shown in load["served_threads"])
        for load in (p5["streams_1"], p5["streams_32"]):  # the CPU each side spent a token, and what it predicts
            cpu = load["cpu_us_per_token"]  # (a server's counters tick every 10 ms: a quick load may read 0)
            assert cpu["engine_us"] > 0 and cpu["client_us"] > 0 and cpu["host_busy_cpus"] >= 0
            assert cpu["predicted_ratio"] == pytest.approx(cpu["engine_us"] / cpu["served_us"])
            if where == "http_api_servers_1":  # the core found in the server's processes, apart from its frontend
                assert cpu["core_us"] >= 0 and cpu["frontends_us"] >= 0 and "server_us" not in cpu
                assert cpu["served_us"] == pytest.approx(cpu["core_us"] + cpu["frontends_us"] + cpu["client_us"])
                assert 0 <= cpu["engine_share"] < 1
            else:  # one process: the engine a thread of it
                assert cpu["server_us"] >= 0 and "core_us" not in cpu
                assert cpu["served_us"] == pytest.approx(cpu["server_us"] + cpu["client_us"])
    assert data["threads"]["threads"] >= 1


def test_write_floor(tmp_path):
    run("write_floor.py", "--out", str(tmp_path / "floor.json"))
    data = json.loads((tmp_path / "floor.json").read_text())
    assert data["streams"] == 4 and data["steps"] == 50 and data["us_per_write"] > 0
    assert data["us_per_write"] == pytest.approx(data["user_us_per_write"] + data["kernel_us_per_write"])


def test_frontend_cpu_beside_its_floor(tmp_path):
    run("frontend_cpu.py", "--out", str(tmp_path / "fe.json"), "--port", "8793")
    load = json.loads((tmp_path / "fe.json").read_text())["loads"]["2x16"]
    assert load["tokens"] == 32 and load["frontend_us_per_token"] > 0 and load["core_us_per_token"] > 0
    assert load["write_floor"]["streams"] == 2 and load["write_floor"]["us_per_write"] > 0
    assert load["frontend_above_floor_us_per_token"] == pytest.approx(
        load["frontend_us_per_token"] - load["write_floor"]["us_per_write"])


def test_pool_settle(tmp_path):
    require_kernel()
    run("pool_settle.py", "--slots", "1", "3", "--out", str(tmp_path / "settle.json"))
    loads = json.loads((tmp_path / "settle.json").read_text())["loads"]
    assert set(loads) == {"1 slots", "3 slots"} and all(load["same_bits"] for load in loads.values())
    assert all(load["pending_settle_us"] > 0 and load["per_state_commits_us"] > 0 for load in loads.values())


@pytest.mark.timeout(COMPILING_S + 60)
def test_compile_vs_eager(tmp_path, compile_cache):
    """The shipped model at 1 slot, decode only: the server's bucket 1, its own build (the suite's servers load fp32
    weights — conftest's LINSERVE_DTYPE —, test_compiled_decode's bucket is bf16's)."""
    run("compile_vs_eager.py", "--out", str(tmp_path / "c.json"), "--port", "8793",
        "--compile-cache-dir", compile_cache, timeout=COMPILING_S)
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["compile_status"] == "compiled" and data["compiled_buckets"] == [1]
    for streams in (1, 8):
        load = data[f"streams_{streams}"]
        assert load["compiled_tokens_per_s"] > 0 and load["eager_tokens_per_s"] > 0


@pytest.mark.timeout(COMPILING_S + 60)
def test_bucket_memory(tmp_path, compile_cache):
    """The shipped model's bucket 1 at 1 slot (test_compiled_decode builds it: one cache)."""
    run("bucket_memory.py", "--out", str(tmp_path / "b.json"), "--cache", compile_cache, timeout=COMPILING_S)
    data = json.loads((tmp_path / "b.json").read_text())["bucket_memory"]
    assert data["sizes"] == [1] and data["vocab"] > 0 and data["table_mb"] > 1
    assert set(data["added_mb"]) == {"all", "anonymous", "file"} and data["rss_after_buckets_mb"]["all"] > 0


def test_served_flatness(tmp_path):
    run("served_flatness.py", "--out-dir", str(tmp_path))
    data = json.loads((tmp_path / "p2_served_flatness.json").read_text())
    assert set(data["bench"]) == {"linear", "softmax"} and data["summary"]["P2"]["ratio"] > 0
    assert (tmp_path / "p2_served_flatness.png").read_bytes()[:4] == b"\x89PNG"


def test_served_phases(tmp_path):
    """A stream alone is one prefill step, then a decode step a token; the steps' time is within the load's."""
    run("served_phases.py", "--out", str(tmp_path / "phases.json"))
    alone, two = json.loads((tmp_path / "phases.json").read_text())["loads"]
    assert alone["load"] == "1x8" and two["load"] == "2x8"
    assert alone["steps"]["prefill"]["steps"] == 1 and alone["steps"]["decode"]["steps"] == 7
    assert alone["steps"].get("mixed", {}).get("steps", 0) == 0
    for load in (alone, two):
        assert 0 < sum(phase["total_s"] for phase in load["steps"].values()) <= load["wall_s"]
        assert load["tokens_per_s"] > 0 and load["first_token_ms"]["p50"] <= load["first_token_ms"]["max"]


def test_first_start(tmp_path):
    """A cold cache: the server streams at once while the compiler child starts (and dies with the server)."""
    result = run("p12_first_start.py", "--out", str(tmp_path / "p12.json"))
    assert re.search(r"^P12\.cold: (PASS|FAIL) \(measured", result.stdout, re.M), result.stdout[-500:]
    data = json.loads((tmp_path / "p12.json").read_text())["P12"]
    assert data["cold"]["first_token_s"] > 0 and data["cold"]["while_compiling"]["tokens"] > 1
    left = []  # no compiler child outlives its server
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"program_compiler" in command and b"linserve-cold-cache-" in command:
            left.append(command)
    assert not left


def test_memory(tmp_path):
    run("memory.py", "--out", str(tmp_path / "p8.json"))
    data = json.loads((tmp_path / "p8.json").read_text())
    assert data["P8"]["state_bytes"]["equal"] is True
    assert data["P8"]["served_rss"]["tokens"] == 2048 and data["P8"]["served_rss"]["end_mb"] > 0
    assert data["P8"]["session_bytes"]["tokens"] == [10, 2000] and data["P8"]["session_bytes"]["pass"] is True


SPEC_TARGETS = [f"p{i}_" for i in range(1, 17)]
# each script's `--help` run as its own `__main__`, all in one process (one import of torch, not sixteen)
HELP_OF_EACH = """
import contextlib, io, json, runpy, sys, traceback
sys.path.insert(0, sys.argv[1])
answers = {}
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        status = "returned without exiting"
    except SystemExit as exit:
        status = exit.code or 0
    except BaseException:
        status = traceback.format_exc()
    answers[script] = [status, out.getvalue()]
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_of_each_target() -> dict[str, list]:
    scripts = {target: [str(path) for path in BENCHMARKS.glob(f"{target}*.py")] for target in SPEC_TARGETS}
    result = subprocess.run([sys.executable, "-c", HELP_OF_EACH, str(BENCHMARKS),
                             *(path for paths in scripts.values() for path in paths)],
                            capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.splitlines()[-1])
    return {target: [answers[path] for path in paths] for target, paths in scripts.items()}


@pytest.mark.parametrize("target", SPEC_TARGETS)
def test_one_entry_script_per_spec_target(target, help_of_each_target):
    (answer,) = help_of_each_target[target]  # (one script a target)
    status, printed = answer
    assert status == 0 and "--quick" in printed, status


def test_resume_cost_by_tier(tmp_path):
    run("p10_resume.py", "--out", str(tmp_path / "p10.json"))
    data = json.loads((tmp_path / "p10.json").read_text())["P10"]
    assert set(data) == {"device", "host", "dir", "redis"} and all(v["ratio"] > 0 for v in data.values())


def test_p13_store_outage(tmp_path):
    require_program("redis-server", "redis-server")
    run("p13_store_outage.py", "--out", str(tmp_path / "p13.json"))
    data = json.loads((tmp_path / "p13.json").read_text())["P13"]
    assert set(data) == {"redis-frozen", "redis-killed", "dir-unwritable"}
    for name, scenario in data.items():
        ledger = {k: scenario[k] for k in ("lost_or_changed", "resurrected", "unacknowledged_listed",
                                           "outcome_unknown_retried", "session_requests")}
        # the ledger holds even in a 2-second run: nothing acknowledged is lost (the message in full: a string)
        assert scenario["ok"], f"{name}: {json.dumps(ledger)}"
        assert scenario["session_requests"]["outage"].get("503")  # the outage was seen as one


def test_serve_startup_against_a_baseline_checkout(tmp_path):
    """Start-up A/B (the baseline here is this same checkout, through the namespace shim): both starts answer."""
    run("serve_startup.py", "--baseline", str(BENCHMARKS.parent), "--out", str(tmp_path / "s.json"), "--port", "8797")
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data["median"]) == {"this tree", "baseline"} and data["verdict"] in ("PASS", "FAIL")
    for median in data["median"].values():
        assert 0 < median["health_s"] <= median["first_token_s"]


def test_served_load(tmp_path):
    run("served_load.py", "--streams", "1", "3", "--out", str(tmp_path / "s.json"), "--port", "8795")
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data["loads"]) == {"streams_1", "streams_3"} and data["loads"]["streams_3"]["tokens_per_s"] > 0
    assert data["server"]["threads"] >= 1 and data["server"]["decode_step"]["compile"] == "off"
    assert ("P11" in data) == (device_name_under_test() == "cuda")


def test_served_load_with_each_frontend_count(tmp_path):
    """`--api-servers 1 2`: one server per count, in turn, each with its own figures."""
    run("served_load.py", "--streams", "2", "--api-servers", "1", "2", "--out", str(tmp_path / "s.json"),
        "--port", "8796", "--compile-wait", "0")
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data["placements"]) == {"api_servers_1", "api_servers_2"}
    for frontends, placement in zip((1, 2), data["placements"].values()):
        assert placement["api_servers"] == frontends and placement["loads"]["streams_2"]["tokens_per_s"] > 0
        # /ready's programs before and after the loads (what a run that did not wait for every bucket measured)
        assert [placement["programs"][when]["compile"] for when in ("at_start", "at_end")] == ["off", "off"]


def test_families_served(tmp_path):
    """fla families served (issue 48's figures on a GPU): each checkpoint's load, and its state bytes as the
    server's /v1/models reports them — the family's own formula."""
    run("families_served.py", "--families", "gla", "retnet", "--streams", "1", "2", "--port", "8792",
        "--out", str(tmp_path / "f.json"))
    sys.path.insert(0, str(BENCHMARKS))
    from p17_families import make_checkpoint

    from linserve.model.checkpoint import load_checkpoint

    models = json.loads((tmp_path / "f.json").read_text())["models"]
    assert set(models) == {"gla-quick", "retnet-quick"}
    for key, entry in models.items():
        formula = load_checkpoint(make_checkpoint(key.split("-")[0], "quick"), "cpu").config.state_bytes()
        assert entry["model_type"] == key.split("-")[0] and entry["state_bytes"] == formula
        assert set(entry["loads"]) == {"streams_1", "streams_2"}
        assert all(load["tokens_per_s"] > 0 for load in entry["loads"].values())


def test_session_affinity(tmp_path):
    for program in ("haproxy", "redis-server"):
        require_program(program, program)
    run("session_affinity.py", "--out", str(tmp_path / "affinity.json"))
    data = json.loads((tmp_path / "affinity.json").read_text())
    assert data["nothing_lost"]["pass"], data["replica_killed"]
    assert data["affinity"]["latency_ms_p50"] > 0 and data["round_robin"]["latency_ms_p99"] > 0
    # the one measurement that is not a timing: hashing on the session id keeps its state where it is
    assert data["affinity"]["loads_per_continue"] < data["round_robin"]["loads_per_continue"]


def test_p14_constrained(tmp_path):
    run("p14_constrained.py", "--out", str(tmp_path / "p14.json"), "--port", "8794")
    data = json.loads((tmp_path / "p14.json").read_text())
    assert data["P14"]["valid"]["pass"], data["P14"]["valid"]  # not a timing: every constrained output validates
    assert data["P14"]["streams_1"]["constrained_itl_ms"]["p50"] > 0 and data["P14"]["streams_4"]["ratio"] > 0


def test_p16_conversation(tmp_path):
    run("p16_conversation.py", "--out", str(tmp_path / "p16.json"), "--port", "8796")
    data = json.loads((tmp_path / "p16.json").read_text())
    assert len(data["ttft_ms"]) == data["turns"] and data["P16"]["ratio"] > 0
    # not a timing: each turn continued the previous one, so the conversation holds every turn's tokens
    assert data["conversation_tokens"] > data["turns"] * data["input_tokens"]


def test_priority_ttft(tmp_path):
    run("priority_ttft.py", "--out", str(tmp_path / "priority.json"), "--port", "8797")
    data = json.loads((tmp_path / "priority.json").read_text())["priority"]
    assert all(len(values) == 3 for values in data["ttft_ms"].values()) and data["urgent_over_idle"] > 0


def test_p13_names_a_missing_program_first(tmp_path):
    """Before anything starts: one line naming the program and its Debian package."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "p13_store_outage.py"), "--quick"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == ("error: redis-server is needed and not on PATH "
                                     "(Debian: apt-get install redis-server)")


def test_p15_speculative(tmp_path):
    # the shipped model as its own draft model (none is shipped): the draft path over HTTP, every draft accepted
    # (and ngram requests asking for at most 2 drafts a step, side by side)
    run("p15_speculative.py", "--out", str(tmp_path / "p15.json"), "--port", "8798",
        "--draft-model", str(DEFAULT_CHECKPOINT), "--compare-k", "2")
    data = json.loads((tmp_path / "p15.json").read_text())
    assert data["k"] == Settings().speculative_k and data["compare_k"] == [2]
    # not a timing: every speculative output equals plain decoding's, and drafts were really verified
    assert data["P15"]["identical"]["pass"], data["results"]
    for method in ("ngram", "draft", "ngram-k2"):  # each verification program is timed at its first chance
        assert sum(load[method]["drafted"] for workload in data["results"].values() for load in workload.values())
    assert all(load["ngram-k2"]["identical"] for workload in data["results"].values() for load in workload.values())
    assert set(data["results"]) == {"shakespeare", "quote", "shakespeare-long"}
    assert data["P15"]["one_stream"]["ratio"] > 0


def test_busy_host(tmp_path):
    """The OpenMP policies beside a busy neighbour (issue 55): each variant a fresh process, quiet and beside a loop."""
    run("busy_host.py", "--out", str(tmp_path / "busy.json"))
    data = json.loads((tmp_path / "busy.json").read_text())
    for neighbour in ("quiet", "busy"):
        assert set(data["seconds"][neighbour]) == {"default", "one_thread"}
        assert all(v["median"] > 0 for v in data["seconds"][neighbour].values())
        assert all(v["median"] > 0 for v in data["decode_step_ms"][neighbour].values())

