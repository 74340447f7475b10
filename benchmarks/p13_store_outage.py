"""P13 store outage: while the session store is down or frozen, a stateless stream's ITL p99 stays <= 1.5x
its baseline (measured in the same run), and no request is acknowledged that was not stored.

For each scenario — Redis frozen (SIGSTOP), Redis killed (SIGKILL, restarted from its append-only file),
the store directory made unwritable — one `linserve serve` (the shipped model) runs a stateless stream
while a client churns sessions (create with a prompt, continue, delete) for `--seconds` with the store up
(the baseline; before it, the stream alone: `quiet`), then as long with the store out. The stream's token
gaps give ITL p99 per phase; the ratio is the outage's p99 over the larger of the other two. After
the store is back, every acknowledged session must be there with exactly its acknowledged tokens, every
acknowledged delete gone, and nothing else listed.

    python benchmarks/p13_store_outage.py [--quick] [--out benchmarks/results/p13_store_outage.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import emit, percentile, wait_until_up  # noqa: E402

TARGET = 1.5
STORE_TIMEOUT_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, directory: Path) -> subprocess.Popen:
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "yes", "--appendfsync", "always", "--dir", str(directory)],
                               stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def unprivileged() -> list[str]:
    """Root ignores file modes: drop the capabilities that let it, so chmod makes the directory unwritable."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--"]


class Stream(threading.Thread):
    """A stateless SSE stream; its token gaps per phase."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.phase, self.gaps = base, "quiet", {"quiet": [], "baseline": [], "outage": [], "after": []}
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"prompt": "ROMEO.\n", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as response:
            last = None
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        self.gaps[self.phase].append(now - last)
                    last = now


class Churn(threading.Thread):
    """Session work beside the stream; what was acknowledged (2xx) is the ledger checked afterwards. Every
    change carries an `Idempotency-Key`; one answered 503 `outcome_unknown` is retried with the same key once
    the store is back (`settle`), as a client must: its answer then says whether it was applied."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.live: dict[str, int] = {}  # acknowledged sessions -> acknowledged tokens
        self.deleted: set[str] = set()
        self.unknown: list[tuple[str, str, dict | None, str]] = []  # (method, path, body, key) to retry
        self.statuses: dict[str, dict[int, int]] = {"baseline": {}, "outage": {}}
        self.phase = "baseline"
        self.stop = threading.Event()
        self.client = httpx.Client(base_url=base, timeout=30)

    def _send(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> httpx.Response:
        key = key or uuid.uuid4().hex
        response = self.client.request(method, path, json=body, headers={"Idempotency-Key": key})
        table = self.statuses.setdefault(self.phase, {})
        table[response.status_code] = table.get(response.status_code, 0) + 1
        if response.status_code == 503 and response.json()["error"]["code"] == "outcome_unknown":
            self.unknown.append((method, path, body, key))
        else:
            self._apply(method, path, response)
        return response

    def _apply(self, method: str, path: str, response: httpx.Response) -> None:
        if path == "/v1/sessions" and response.status_code == 200:
            self.live[response.json()["id"]] = response.json()["tokens"]
        elif method == "POST" and response.status_code == 200:
            self.live[path.split("/")[3]] += response.json()["usage"]["total_tokens"]
        elif method == "DELETE" and response.status_code == 204:
            sid = path.split("/")[3]
            del self.live[sid]
            self.deleted.add(sid)

    def run(self) -> None:
        while not self.stop.is_set():
            self._send("POST", "/v1/sessions", {"prompt": "HAMLET.\nTo be"})
            pending = {path.split("/")[3] for _, path, _, _ in self.unknown if path != "/v1/sessions"}
            for sid in [s for s in self.live if s not in pending][-2:]:
                self._send("POST", f"/v1/sessions/{sid}/completions", {"prompt": " and", "max_tokens": 8,
                                                                       "temperature": 0})
            if len(self.live) > 4 and (sid := next((s for s in self.live if s not in pending), None)):
                self._send("DELETE", f"/v1/sessions/{sid}")
            time.sleep(0.02)

    def settle(self) -> None:
        """Retry each change whose outcome was unknown, with its key, until the store answers it."""
        self.phase = "settle"
        for method, path, body, key in self.unknown:
            for _ in range(100):
                response = self.client.request(method, path, json=body, headers={"Idempotency-Key": key})
                if response.status_code not in (409, 503):  # 409: the session is still busy with it
                    self._apply(method, path, response)
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError(f"{method} {path} still unanswered after the store came back: {response.text}")


def verify(base: str, churn: Churn) -> dict:
    """Every acknowledged session there with its acknowledged tokens, every acknowledged delete gone."""
    wrong = []
    for sid, tokens in churn.live.items():
        got = httpx.get(f"{base}/v1/sessions/{sid}", timeout=30)
        if got.status_code != 200 or got.json()["tokens"] != tokens:
            wrong.append((sid, tokens, got.status_code, got.text[:100]))
    resurrected = [sid for sid in churn.deleted
                   if httpx.get(f"{base}/v1/sessions/{sid}", timeout=30).status_code != 404]
    for _ in range(50):  # a create whose outcome was unknown is deleted again by the server, in the background
        listed = {s["id"] for s in httpx.get(f"{base}/v1/sessions", params={"limit": 100}, timeout=30).json()["data"]}
        if listed == set(churn.live):
            break
        time.sleep(0.1)
    return {
        "acknowledged_sessions": len(churn.live),
        "acknowledged_deletes": len(churn.deleted),
        "outcome_unknown_retried": len(churn.unknown),
        "lost_or_changed": wrong,
        "resurrected": resurrected,
        "unacknowledged_listed": sorted(listed - set(churn.live)),
        "ok": not wrong and not resurrected and listed == set(churn.live),
    }


def scenario(name: str, seconds: float, checkpoint: str | None, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    redis = None
    env = {**os.environ, "LINSERVE_COMPILE": "off", "LINSERVE_SESSION_STORE_TIMEOUT_S": str(STORE_TIMEOUT_S)}
    prefix: list[str] = []
    store_dir = work / "sessions"
    if name.startswith("redis"):
        port = free_port()
        redis = start_redis(port, work)
        env["LINSERVE_SESSION_STORE"] = f"redis://127.0.0.1:{port}/0"
    else:
        store_dir.mkdir(exist_ok=True)
        env["LINSERVE_SESSION_STORE"] = f"dir:{store_dir}"
        prefix = unprivileged()
    http_port = free_port()
    command = [*prefix, sys.executable, "-m", "linserve.server.cli", "serve", "--port", str(http_port),
               "--log-level", "error"]
    if checkpoint:
        command += ["--model", checkpoint]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_until_up(server, f"{base}/ready", "linserve serve")
        stream, churn = Stream(base), Churn(base)
        stream.start()
        time.sleep(seconds)  # the stream alone
        stream.phase = "baseline"
        churn.start()  # the same stream beside session traffic, the store up
        time.sleep(seconds)
        stream.phase = churn.phase = "outage"
        if name == "redis-frozen":
            redis.send_signal(signal.SIGSTOP)
        elif name == "redis-killed":
            redis.kill()
            redis.wait(10)
        else:
            store_dir.chmod(0o500)
        time.sleep(seconds)
        churn.stop.set()
        churn.join(60)
        stream.phase = "after"
        if name == "redis-frozen":
            redis.send_signal(signal.SIGCONT)
        elif name == "redis-killed":
            redis = start_redis(port, work)
        else:
            store_dir.chmod(0o700)
        for _ in range(200):
            if httpx.get(f"{base}/ready", timeout=5).json()["session_store"]["up"]:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        churn.settle()
        stream.stop.set()
        p99 = {phase: percentile(stream.gaps[phase], 0.99) * 1e3 for phase in ("quiet", "baseline", "outage")}
        ratio = p99["outage"] / max(p99["quiet"], p99["baseline"])
        ledger = verify(base, churn)
        return {
            "itl_p99_ms": p99,
            "tokens": {p: len(g) for p, g in stream.gaps.items()},
            "ratio": ratio,
            "ratio_vs_quiet": p99["outage"] / p99["quiet"],
            "session_requests": churn.statuses,
            **ledger,
            "target": f"<= {TARGET}x and nothing lost",
            "pass": ratio <= TARGET and ledger["ok"],
        }
    finally:
        server.terminate()
        server.wait(30)
        if redis is not None:
            redis.send_signal(signal.SIGCONT)
            redis.kill()
            redis.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase (quiet, baseline, outage)")
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped one)")
    parser.add_argument("--quick", action="store_true", help="2-second phases: checks that it runs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    packages = {"redis-server": "redis-server", "setpriv": "util-linux"}  # program → its Debian package
    for program in ("redis-server", *(["setpriv"] if os.geteuid() == 0 else [])):
        if shutil.which(program) is None:  # before anything starts: one line naming what to install
            raise SystemExit(f"error: {program} is needed and not on PATH (Debian: apt-get install "
                             f"{packages[program]})")
    with tempfile.TemporaryDirectory() as work:
        results = {
            name: scenario(name, seconds, args.model, Path(work) / name)
            for name in ("redis-frozen", "redis-killed", "dir-unwritable")
        }
    emit({"P13": results, "phase_seconds": seconds, "store_timeout_s": STORE_TIMEOUT_S}, args.out)


if __name__ == "__main__":
    main()
