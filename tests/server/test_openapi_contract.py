"""schemathesis, every check on, over the server's own /openapi.json against a real `linserve serve`:
the document matches what the server does, and no generated request — valid or not — gets a 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_schemathesis_finds_nothing(tiny_checkpoint, tmp_path):
    beside = Path(sys.executable).with_name("st")  # the CLI installed with this interpreter's schemathesis
    st = str(beside) if beside.exists() else shutil.which("st")
    assert st, "schemathesis is a dev dependency (pip install -e '.[dev]')"
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--num-slots", "8",
                           env={"LINSERVE_MAX_TOKENS_LIMIT": "16"})
    try:
        result = subprocess.run(
            [st, "--config-file", str(CONFIG), "run", f"{server.base}/openapi.json", "--checks", "all",
             "--max-examples", "30", "--seed", "20261122", "--request-timeout", "30", "--continue-on-failure",
             "--no-color"],
            capture_output=True, text=True, timeout=400, cwd=tmp_path)
    finally:
        server.stop()
    summary = result.stdout[-4000:]
    assert result.returncode == 0, summary
    assert " passed" in summary and "failures" not in summary.split("SUMMARY")[-1]
