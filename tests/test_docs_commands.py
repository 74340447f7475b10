"""Every command a user is told to run in README.md and docs/ runs as written.

Each ```bash block carries a tag on the line before it: `<!-- doc-test: run -->` (the block runs alone, starting
what it needs), `<!-- doc-test: with-server -->` (it runs against `linserve serve` of the shipped model on
127.0.0.1:8000, as the docs assume), or `<!-- doc-test: not-run: <why> -->` (a long-running server, hours of
training, another machine's tools — said in the tag). A block runs under `bash -e -o pipefail` in the
repository's root (where the docs say to run them), with this environment's `bin/` first on PATH, sessions stored
in a scratch directory unless the block says otherwise, and `curl` failing on an HTTP error status; whatever it
starts in the background is stopped afterwards, and whatever it writes in the root is removed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import require_program

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TAG = re.compile(r"<!-- doc-test: (run|with-server|not-run: .+) -->")
PORT = 8000  # the docs' own
# curl fails on an HTTP error status (a block's own -f / --fail stays as written: curl takes only one of them)
PRELUDE = """curl() {
  for arg in "$@"; do case "$arg" in --fail|--fail-with-body|-[a-zA-Z]*f*) command curl "$@"; return;; esac; done
  command curl --fail-with-body "$@"
}
export -f curl
"""


def blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, tag, code) of every bash block."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() != "```bash":
                continue
            end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
            tag = TAG.fullmatch(lines[number - 1].strip()) if number else None
            found.append((path.relative_to(ROOT).as_posix(), number + 1, tag.group(1) if tag else "",
                          "\n".join(lines[number + 1:end]) + "\n"))
    return found


RUNNABLE = [(f"{name}:{line}", tag, code) for name, line, tag, code in blocks() if tag in ("run", "with-server")]


def test_every_command_block_says_whether_and_how_it_runs():
    untagged = [f"{name}:{line}" for name, line, tag, _ in blocks() if not tag]
    assert not untagged, f"bash blocks without a doc-test tag: {untagged}"
    assert len(RUNNABLE) >= 6


def wait_ready(base: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("linserve serve exited")
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("linserve serve did not become ready")


def installed_torch(env: dict) -> str:
    probe = "import importlib.metadata as m; print(m.version('torch'))"  # no import of torch itself: fast
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env).stdout.strip()


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process and everything it started (its session), then wait until all of them are gone
    (a redis-server writes its dump on the way out); SIGKILL after 30 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        process.poll()
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(960)
@pytest.mark.parametrize("where, tag, code", RUNNABLE, ids=[where for where, _, _ in RUNNABLE])
def test_the_block_runs_as_written(where, tag, code, tmp_path):
    require_program("curl", "curl")
    if "jq " in code:
        require_program("jq", "jq")
    if "redis-server" in code:
        require_program("redis-server", "redis-server")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "LINSERVE_COMPILE": "off",
           "LINSERVE_SESSION_STORE": f"dir:{tmp_path / 'sessions'}"}
    before = set(os.listdir(ROOT))
    torch_before = installed_torch(env) if "pip install" in code else None
    server = None
    if tag == "with-server":
        server = subprocess.Popen([sys.executable, "-m", "linserve.server.cli", "serve", "--port", str(PORT)],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        wait_ready(f"http://127.0.0.1:{PORT}", server)
    log = tmp_path / "block.log"  # a file, not a pipe: what the block starts in the background keeps it open
    with open(log, "w") as out:
        shell = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", PRELUDE + code], cwd=ROOT, env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            shell.wait(900)
        finally:
            stop(shell)  # and whatever it left running in the background
            if server is not None:
                stop(server)
            for name in set(os.listdir(ROOT)) - before:  # what the block wrote (results/, a snapshot, …)
                target = ROOT / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
    assert shell.returncode == 0, f"{where} failed ({shell.returncode}):\n{log.read_text()[-4000:]}"
    if torch_before is not None:  # an install the docs tell a user to run keeps the torch they have
        assert installed_torch(env) == torch_before
