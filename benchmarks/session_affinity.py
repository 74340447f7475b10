"""Session affinity with two real replicas behind the shipped haproxy (issue 31).

Two `linserve serve` replicas share one redis-server (append-only). The same conversation load — `--clients`
clients, each continuing its own sessions turn after turn (every turn with its own Idempotency-Key) — runs
through haproxy with docker/haproxy.cfg as shipped (consistent hashing on the session id) and with the same
file switched to `balance roundrobin` (what shipped before), interleaved. Per mode: state loads from the store
per continue (`linserve_session_store_loads_total`, summed over the replicas) and continue latency p50 / p99.
Loads are counted after one warm-up turn of every session (a create without a key is round robin, so its first
continue may load it once under either mode), and each client visits its sessions in a shuffled order every
round: a fixed order can make round robin send a session to the same replica every time by coincidence.
Then, with affinity, one replica is SIGKILLed mid-run: its sessions move to the other, and every acknowledged
turn must be in the session afterwards (tokens = the sum of acknowledged usage).

    python benchmarks/session_affinity.py [--quick] [--out benchmarks/results/session_affinity.json]
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import emit, percentile, wait_until_up  # noqa: E402
from benchmarks.p13_store_outage import free_port, start_redis  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TURN = {"prompt": " and", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def haproxy_config(port: int, replicas: list[int], affinity: bool) -> str:
    config = (ROOT / "docker" / "haproxy.cfg").read_text()
    config = re.sub(r"^(\s*bind\s+):8000\s*$", rf"\g<1>127.0.0.1:{port}", config, flags=re.M)
    for number, replica in enumerate(replicas, 1):
        config = config.replace(f"linserve-{number}:8000", f"127.0.0.1:{replica}")
    if not affinity:
        config = re.sub(r"^\s*balance hdr\(X-Linserve-Affinity\).*$", "    balance roundrobin", config, flags=re.M)
        config = re.sub(r"^\s*hash-type consistent\s*$", "", config, flags=re.M)
    return config


def loads(bases: list[str]) -> float:
    total = 0.0
    for base in bases:
        try:
            text = httpx.get(f"{base}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue  # a killed replica: its count is gone with it
        total += sum(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("linserve_session_store_loads_total "))
    return total


class Client(threading.Thread):
    """Continues its sessions round after round; a failed turn is retried with its key until answered."""

    def __init__(self, lb: str, sessions: dict[str, int], turns: int, tag: str) -> None:
        super().__init__(daemon=True)
        self.lb, self.sessions, self.turns, self.tag = lb, sessions, turns, tag
        self.latencies: list[float] = []
        self.retries = 0
        self.done_turns = 0
        self.order = random.Random(tag)

    def run(self) -> None:
        with httpx.Client(base_url=self.lb, timeout=60) as client:
            for turn in range(self.turns):
                for sid in self.order.sample(list(self.sessions), len(self.sessions)):
                    self.latencies.append(self.turn(client, sid, f"{self.tag}-{sid}-{turn}"))
                    self.done_turns += 1

    def turn(self, client: httpx.Client, sid: str, key: str) -> float:
        """One acknowledged continue (retried with its key until answered); its latency."""
        while True:
            started = time.perf_counter()
            try:
                answer = client.post(f"/v1/sessions/{sid}/completions", json=TURN, headers={"Idempotency-Key": key})
            except httpx.HTTPError:
                answer = None
            if answer is not None and answer.status_code == 200:
                break
            self.retries += 1
            time.sleep(0.2)
        self.sessions[sid] += answer.json()["usage"]["total_tokens"]
        return time.perf_counter() - started


def run_mode(lb: str, bases: list[str], sessions: int, clients: int, turns: int, tag: str,
             kill: subprocess.Popen | None = None) -> dict:
    made = [httpx.post(f"{lb}/v1/sessions", json={"prompt": "HAMLET.\nTo be"}, timeout=60).json()
            for _ in range(sessions)]
    owned = [{m["id"]: m["tokens"] for m in made[c::clients]} for c in range(clients)]
    workers = [Client(lb, owned[c], turns - 1, f"{tag}-{c}") for c in range(clients)]
    with httpx.Client(base_url=lb, timeout=60) as client:  # the warm-up turn: each session where it will stay
        for worker in workers:
            for sid in worker.sessions:
                worker.turn(client, sid, f"{worker.tag}-{sid}-warm")
    before = loads(bases)
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    if kill is not None:  # mid-run: half the turns done
        while sum(w.done_turns for w in workers) < sessions * (turns - 1) // 2:
            time.sleep(0.05)
        kill.send_signal(signal.SIGKILL)
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - started
    latencies = [x for w in workers for x in w.latencies]
    result = {"continues": len(latencies), "seconds": round(wall, 2),
              "latency_ms": {"p50": round(1e3 * percentile(latencies, 0.5), 2),
                             "p99": round(1e3 * percentile(latencies, 0.99), 2)},
              "retried": sum(w.retries for w in workers)}
    if kill is None:
        result["loads_per_continue"] = round((loads(bases) - before) / len(latencies), 3)
    lost = []
    for worker in workers:
        for sid, tokens in worker.sessions.items():
            got = httpx.get(f"{lb}/v1/sessions/{sid}", timeout=60).json()["tokens"]
            if got != tokens:
                lost.append({"session": sid, "acknowledged_tokens": tokens, "tokens": got})
    result["sessions_with_lost_or_extra_turns"] = lost
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=10, help="per session, the warm-up turn included")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="affinity / round-robin pairs, interleaved")
    parser.add_argument("--quick", action="store_true", help="8 sessions x 4 turns, one round (a smoke run)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns, args.rounds = 8, 4, 1
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        redis_port = free_port()
        redis = start_redis(redis_port, directory)
        ports = [free_port(), free_port()]
        replicas = []
        for number, port in enumerate(ports, 1):
            command = [sys.executable, "-m", "linserve.server.cli", "serve", "--port", str(port), "--compile", "off",
                       "--session-store", f"redis://127.0.0.1:{redis_port}/0", "--log-level", "warning"]
            log = open(directory / f"replica-{number}.log", "w")
            replicas.append(wait_until_up(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT),
                                          f"http://127.0.0.1:{port}/ready", f"replica {number}"))
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        result: dict = {"replicas": 2, "sessions": args.sessions, "turns": args.turns, "clients": args.clients,
                        "compile": "off", "runs": {"affinity": [], "round_robin": []}}
        try:
            for round_number in range(args.rounds):
                for mode in ("affinity", "round_robin"):
                    result["runs"][mode].append(balanced(directory, ports, bases, mode, args, f"r{round_number}"))
            result["replica_killed"] = balanced(directory, ports, bases, "affinity", args, "kill", kill=replicas[1])
        finally:
            for process in [*replicas, redis]:
                process.kill()
                process.wait(10)
    for mode, runs in result["runs"].items():
        result[mode] = {key: round(sum(r[key] if key != "latency_ms" else 0 for r in runs) / len(runs), 3)
                        for key in ("loads_per_continue",)}
        result[mode]["latency_ms_p50"] = round(sum(r["latency_ms"]["p50"] for r in runs) / len(runs), 2)
        result[mode]["latency_ms_p99"] = round(sum(r["latency_ms"]["p99"] for r in runs) / len(runs), 2)
    result["p50_ratio_round_robin_over_affinity"] = round(
        result["round_robin"]["latency_ms_p50"] / result["affinity"]["latency_ms_p50"], 2)
    result["nothing_lost"] = {"target": "every acknowledged turn kept, none applied twice",
                              "measured": len(result["replica_killed"]["sessions_with_lost_or_extra_turns"]),
                              "pass": not result["replica_killed"]["sessions_with_lost_or_extra_turns"]
                              and all(not r["sessions_with_lost_or_extra_turns"] for rs in result["runs"].values()
                                      for r in rs)}
    emit(result, args.out)


def balanced(directory: Path, ports: list[int], bases: list[str], mode: str, args, tag: str,
             kill: subprocess.Popen | None = None) -> dict:
    """One run of the load through a fresh haproxy in `mode`."""
    lb_port = free_port()
    config = directory / f"haproxy-{tag}-{mode}.cfg"
    config.write_text(haproxy_config(lb_port, ports, mode == "affinity"))
    haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        lb = f"http://127.0.0.1:{lb_port}"
        wait_until_up(haproxy, f"{lb}/ready", "haproxy")  # (servers start up: the first checks only confirm it)
        return run_mode(lb, bases, args.sessions, args.clients, args.turns, f"{tag}-{mode}", kill)
    finally:
        haproxy.terminate()
        haproxy.wait(10)


if __name__ == "__main__":
    main()
