"""The GPU suite in one command (`bash benchmarks/gpu.sh`): on a machine with CUDA, the test suite on CUDA,
P1 and P6 (the decode step against context and against one read of the weights), P5 (HTTP vs in-engine), a
served load at 1/32/128 streams (P11), P15 (speculative decoding), and the CPU thread sweep of this larger
machine; one results file and the rows for docs/benchmarks.md's GPU table, with the machine named.

    bash benchmarks/gpu.sh [--parts tests,fla,p1p6,p5,served,p12,p15,families,threads] [--quick] [--out-dir DIR]
        [--tests 'PYTEST ARGS'] [--workers N] [--timeout PART=SECONDS ...] [--compile-wait SECONDS]

Without CUDA it says so, runs the CPU-only parts (the thread sweep) and exits 0: CI runs it that way. Each
part is a separate child process with its own deadline; a part that fails is recorded as failed and the rest
still run. Parts can be run one call at a time (a lent GPU may allow minutes per command): each call merges its
parts into DIR/gpu_suite.json and rewrites DIR/gpu_rows.md from everything measured there so far.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GPU_PARTS = ("tests", "fla", "p1p6", "p5", "served", "p12", "p15", "families")
CPU_PARTS = ("threads",)
PART_TIMEOUT_S = {"tests": 1800, "fla": 900, "p1p6": 900, "p5": 900, "served": 1200, "p12": 900, "p15": 1200,
                  "families": 1200, "threads": 1800}
# on the GPU the programs are compiled in the serving process, into this cache: P12's cold start fills it
# (emptied first), its restart and the served parts after it read it
SUITE_CACHE = os.path.join(tempfile.gettempdir(), "linserve-gpu-suite-cache")
# the part whose reference is fla's real kernels on the GPU (tests/model/families/fla_reference.py)
PART_ENV = {"fla": {"LINSERVE_FLA_GPU": "1"},
            **{part: {"LINSERVE_COMPILE_CACHE_DIR": SUITE_CACHE} for part in ("p5", "served", "p15")}}
SERVED_STREAMS = (1, 32, 128)
# one frontend and four: one tops out near 40,000 streamed tokens/s by docs/engine.md's host-cost model, P11's 128
SERVED_FRONTENDS = (1, 4)


def machine() -> dict:
    """What the figures were measured on (the GPU's name, the CPU, the cores this process may use)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpu": cpu,
            "cpus_usable": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": datetime.date.today().isoformat()}


def run_part(name: str, command: list[str], timeout_s: float) -> dict:
    env = PART_ENV.get(name, {})
    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), *command])
    print(f"== {name}: {shown}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryFile() as log:  # kept on a timeout too (subprocess.run drops it there)
        child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                 start_new_session=True)  # its own group: a timeout ends its helpers as well
        try:
            status = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = "timeout"
        log.seek(0)
        tail = log.read().decode(errors="replace")[-3000:]
    seconds = time.monotonic() - started
    print(f"   {name}: status {status} in {seconds:.0f} s", flush=True)
    return {"command": shown, "status": status, "seconds": round(seconds, 1), "output_tail": tail}


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def part_commands(name: str, out: Path, quick: bool, tests: list[str] | None = None, workers: int = 0,
                  compile_wait: float | None = None) -> list[str]:
    py = sys.executable
    q = ["--quick"] if quick else []
    wait = ["--compile-wait", str(compile_wait)] if compile_wait is not None else []
    if name == "tests":
        return [py, "-m", "pytest", "-q", "--device", "cuda", "-p", "no:cacheprovider",
                *(["-n", str(workers)] if workers else []),
                *(tests or (["tests/model/test_decode_step.py"] if quick else ["tests"]))]
    if name == "fla":
        return [py, "-m", "pytest", "-q", "--device", "cuda", "-p", "no:cacheprovider",
                "tests/model/families/test_against_fla.py"]
    if name == "families":
        return [py, "benchmarks/families_served.py", "--device", "cuda", *q, "--compile", "off",
                "--out", str(out / "families.json")]
    if name == "p1p6":
        return [py, "benchmarks/decode_vs_context.py", "--device", "cuda", *q, "--out", str(out / "p1_p6.json"),
                "--plot", str(out / "p1_decode_vs_context.png")]
    if name == "p5":
        # the served part's slot count: its compiled buckets, in the same cache, serve here too
        return [py, "benchmarks/serving_overhead.py", "--device", "cuda", *q, "--slots", str(max(SERVED_STREAMS)),
                *wait, "--out", str(out / "p5.json")]
    if name == "served":
        return [py, "benchmarks/served_load.py", "--device", "cuda", *q, "--streams",
                *(str(n) for n in SERVED_STREAMS), "--api-servers", *(str(n) for n in SERVED_FRONTENDS), *wait,
                "--out", str(out / "served.json")]
    if name == "p12":  # first start on the GPU: first token, every bucket at graph speed, the warm cache
        return [py, "benchmarks/p12_first_start.py", "--device", "cuda", *q, "--cold-cache", SUITE_CACHE,
                "--warm-cache", "same", "--out", str(out / "p12.json")]
    if name == "p15":
        return [py, "benchmarks/p15_speculative.py", "--device", "cuda", *q, "--out", str(out / "p15.json")]
    if name == "threads":
        return [py, "benchmarks/threads.py", *q, "--out", str(out / "threads.json")]
    raise ValueError(name)


def rows(results: dict) -> list[str]:
    """docs/benchmarks.md's GPU table rows from whatever parts have results."""
    m = results.get("machine", {})
    where = f"{m.get('gpu') or 'no GPU'}, {m.get('cpus_usable')} CPUs, torch {m.get('torch')}, {m.get('date')}"
    parts, lines = results.get("parts", {}), []
    for name, what in (("tests", "test suite on CUDA"), ("fla", "fla families against fla's GPU kernels")):
        if name in parts:
            tail = parts[name]["output_tail"].strip().splitlines()
            lines.append(f"| {what} ({where}) | {tail[-1] if tail else parts[name]['status']} | all pass | "
                         f"{'PASS' if parts[name]['status'] == 0 else 'FAIL'} | `{parts[name]['command']}` |")
    p1p6 = parts.get("p1p6", {}).get("result")
    if p1p6:
        for key in ("P1", "P6"):
            entry = p1p6.get(key, {})
            lines.append(f"| {key} ({where}) | {entry.get('ratio', float('nan')):.3g} | {entry.get('target')} | "
                         f"{'PASS' if entry.get('pass') else 'FAIL'} | `{parts['p1p6']['command']}` |")
    p5 = parts.get("p5", {}).get("result")
    if p5:
        for placement, by_streams in p5.get("P5", {}).items():
            for streams, entry in by_streams.items():
                lines.append(f"| P5 {placement} {streams} ({where}) | {entry['ratio']:.3g} "
                             f"({entry['http_tokens_per_s']:.0f} vs {entry['engine_tokens_per_s']:.0f} tok/s) | "
                             f"{entry['target']} | {'PASS' if entry['pass'] else 'FAIL'} | "
                             f"`{parts['p5']['command']}` |")
    served = parts.get("served", {}).get("result")
    if served:
        for placement, figures in served.get("placements", {"": served}).items():
            for key, entry in figures.get("P11", {}).items():
                named = f"{placement} {key}" if placement else key
                lines.append(f"| P11 {named} ({where}) | {entry['measured']:.4g} | {entry['target']} | "
                             f"{'PASS' if entry['pass'] else 'FAIL'} | `{parts['served']['command']}` |")
    p12 = parts.get("p12", {}).get("result")
    if p12:
        cold, warm = p12.get("P12", {}).get("cold", {}), p12.get("P12", {}).get("warm", {})
        for key, entry in (("first token, cold", cold), ("every bucket at graph speed, cold", cold.get("graph_speed")),
                           ("every bucket compiled, warm cache", warm)):
            if entry:
                lines.append(f"| P12 {key} ({where}) | {entry.get('measured')} s | {entry.get('target')} | "
                             f"{'PASS' if entry.get('pass') else 'FAIL'} | `{parts['p12']['command']}` |")
    p15 = parts.get("p15", {}).get("result")
    if p15:
        for key, entry in p15.get("P15", {}).items():
            measured = entry.get("ratio", entry.get("measured"))
            lines.append(f"| P15 {key} ({where}) | {measured} | {entry['target']} | "
                         f"{'PASS' if entry['pass'] else 'FAIL'} | `{parts['p15']['command']}` |")
    families = parts.get("families", {}).get("result")
    for key, entry in (families or {}).get("models", {}).items():
        rates = ", ".join(f"{k.split('_')[1]}: {v['tokens_per_s']:.0f}" for k, v in entry["loads"].items())
        lines.append(f"| {key} served, tokens/s by streams ({where}) | {rates}; state {entry['state_bytes']} B, "
                     f"{entry.get('sessions_in_free_memory')} sessions in free memory | — | — | "
                     f"`{parts['families']['command']}` |")
    threads = parts.get("threads", {}).get("result")
    if threads:
        best = threads.get("best", {})
        lines.append(f"| CPU threads sweep ({where}) | best {best} | — | — | `{parts['threads']['command']}` |")
    return lines


def write(results: dict, out: Path) -> list[str]:
    """gpu_suite.json and gpu_rows.md in `out`; the rows."""
    (out / "gpu_suite.json").write_text(json.dumps(results, indent=2) + "\n")
    table = rows(results)
    (out / "gpu_rows.md").write_text("\n".join(table) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(GPU_PARTS + CPU_PARTS))
    parser.add_argument("--quick", action="store_true", help="short versions of every part (tests of this script)")
    parser.add_argument("--out-dir", default=str(HERE / "results" / "gpu"))
    parser.add_argument("--tests", type=shlex.split, help="the tests part's pytest arguments, one string "
                        "(default: the whole suite), e.g. --tests 'tests/server/engine -m \"not slow\"'")
    parser.add_argument("--workers", type=int, default=0, help="the tests part's pytest-xdist workers (-n)")
    parser.add_argument("--compile-wait", type=float, metavar="SECONDS",
                        help="served and p5: measure after this long even if buckets are still compiling "
                        "[default: wait for every bucket]")
    parser.add_argument("--timeout", nargs="+", default=[], metavar="PART=SECONDS",
                        help="a part's deadline instead of its default")
    args = parser.parse_args(argv)
    deadlines = {**PART_TIMEOUT_S, **{k: float(v) for k, v in (t.split("=", 1) for t in args.timeout)}}
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(wanted) - set(GPU_PARTS + CPU_PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(GPU_PARTS + CPU_PARTS)}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "gpu_suite.json"
    results = load_json(results_path) or {}
    results["machine"] = machine()
    cuda = torch.cuda.is_available()
    if not cuda:
        skipped = [p for p in wanted if p in GPU_PARTS]
        print(f"no CUDA device on this machine: GPU parts skipped ({', '.join(skipped) or 'none asked for'}); "
              "running the CPU-only parts", flush=True)
        wanted = [p for p in wanted if p in CPU_PARTS]
    for name in wanted:
        command = part_commands(name, out, args.quick, args.tests, args.workers, args.compile_wait)
        json_out = next((Path(a) for a in command if a.endswith(".json")), None)
        if json_out:
            json_out.unlink(missing_ok=True)  # (an earlier run's file is not this run's result)
        record = run_part(name, command, deadlines[name])
        # (a part cut short keeps what it wrote: served_load writes each server's figures as they come)
        record["result"] = load_json(json_out) if json_out else None
        results.setdefault("parts", {})[name] = record
        write(results, out)  # after each part: a call cut short keeps what it measured
    table = write(results, out)
    print("\n".join(table))
    print(f"wrote {results_path} and {out / 'gpu_rows.md'}")
    failed = [n for n in wanted if results["parts"][n]["status"] != 0]
    if failed:
        print(f"failed parts: {', '.join(failed)} (see output_tail in {results_path})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
