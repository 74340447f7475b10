"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import torch


def compile_settled(body: dict) -> bool:
    """linserve's /ready body: nothing left to compile (every decode bucket ready, or eager for good)."""
    from linserve.server.engine.compiled_decode import SETTLED

    step = body.get("decode_step")
    return step is None or step["status"] in SETTLED


def wait_until_up(process: subprocess.Popen, url: str, what: str, timeout_s: float = 120.0,
                  settled=None) -> subprocess.Popen:
    """Poll `url` until it answers 200 (and `settled(json body)` holds, if given); kill the process and
    raise if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=1)
            if response.status_code == 200 and (settled is None or settled(response.json())):
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s")


def add_compile_argument(parser) -> None:
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="linserve's decode step (default auto, as `linserve serve`); measured once compiled")


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (default: cpu; auto picks CUDA when available)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device on this machine")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a wall-clock timing covers the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> dict:
    """What the numbers were measured on (goes into every result file)."""
    info = {"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON, then a PASS/FAIL line per SPEC target in it; write the JSON to `out`."""
    text = json.dumps(result, indent=2)
    print(text)
    for _, verdict in targets(result):
        print(verdict)
    if out:
        Path(out).write_text(text + "\n")


def targets(result: dict, prefix: str = ""):
    """(name, 'P4: PASS (ratio 8.3, target >= 8x)') for every entry with a target and a pass flag."""
    for key, value in result.items():
        if isinstance(value, dict):
            if "target" in value and "pass" in value:
                measured = value.get("ratio", value.get("speedup", value.get("growth")))
                shown = f"{measured:.3g}" if isinstance(measured, float) else measured
                yield (
                    prefix + str(key),
                    f"{prefix}{key}: {'PASS' if value['pass'] else 'FAIL'} "
                    f"(measured {shown}, target {value['target']})",
                )
            else:
                yield from targets(value, f"{prefix}{key}.")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
