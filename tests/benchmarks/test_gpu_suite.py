"""benchmarks/gpu.sh and gpu_wheels.sh as CI can run them: no GPU, the CPU parts and the wheel list."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.benchmarks import BENCHMARKS

pytestmark = pytest.mark.slow


def test_gpu_suite_without_a_gpu_says_so_and_runs_the_cpu_parts(tmp_path):
    """What CI runs of `bash benchmarks/gpu.sh`: no CUDA (hidden even where there is one), so the GPU parts are
    skipped, the thread sweep runs, and one results file plus the table rows are written; exit status 0."""
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "--quick", "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                            cwd=BENCHMARKS.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = "GPU parts skipped (tests, fla, p1p6, p5, served, p12, p15, families)"
    assert f"no CUDA device on this machine: {skipped}" in result.stdout
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert data["machine"]["gpu"] is None and data["machine"]["cpus_usable"] >= 1
    assert set(data["parts"]) == {"threads"} and data["parts"]["threads"]["status"] == 0
    sweep = data["parts"]["threads"]["result"]
    assert set(sweep["configs"]) == {"1 threads, default", "2 threads, default"}
    assert all(row["1_stream"]["tokens_per_s"] > 0 for row in sweep["configs"].values())
    assert [row["threads"] for row in sweep["configs"].values()] == [1, 2]  # each server ran with its count
    assert "CPU threads sweep" in (tmp_path / "gpu_rows.md").read_text()


def test_gpu_wheels_names_only_pinned_packages_the_gpu_image_lacks():
    """benchmarks/gpu_wheels.sh downloads each package at configs/constraints.txt's pin: every name it lists has
    one, and the server's own dependencies that the GPU image lacks are all among them."""
    script = (BENCHMARKS / "gpu_wheels.sh").read_text()
    names = re.search(r"PACKAGES=\(([^)]*)\)", script).group(1).split()
    pins = {re.split(r"==", line)[0].lower().replace("_", "-") for line in
            (BENCHMARKS.parent / "configs" / "constraints.txt").read_text().splitlines() if "==" in line}
    listed = {name.lower().replace("_", "-") for name in names}
    assert listed <= pins, listed - pins
    assert {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "pydantic-settings", "redis",
            "llguidance", "fastapi-offline", "httptools"} <= listed


def test_gpu_suite_rejects_an_unknown_part(tmp_path):
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "--parts", "tests,nope", "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent)
    assert result.returncode == 2 and "unknown parts ['nope']" in result.stderr
