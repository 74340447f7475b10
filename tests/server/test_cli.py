"""The `linserve` console script, run as a real process."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120)


def test_info_reports_state_bytes_from_config():
    result = run_cli("info", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "state_bytes_per_session=" in result.stdout


def test_generate_streams_at_most_max_tokens():
    result = run_cli("generate", "Hello", "--max-tokens", "12", "--device", "cpu", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello")
    generated = int(result.stderr.split("[")[-1].split(" tokens in")[0])
    assert 1 <= generated <= 12


def test_missing_checkpoint_is_a_clear_error():
    result = run_cli("generate", "x", "--model", "/nonexistent/dir")
    assert result.returncode != 0
    assert "not a checkpoint directory" in result.stderr
