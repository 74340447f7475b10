"""The stack's configuration files run by the real programs on 127.0.0.1: haproxy (Debian's package) with
docker/haproxy.cfg in front of two real `linserve serve` replicas on a real redis-server, and Prometheus
(Debian's package) with docker/prometheus.yml scraping them. Only addresses are rewritten (compose's service
names → local ports); every other line is the repo's.

- Every PromQL expression of the Grafana dashboard, evaluated through Prometheus's HTTP API after a short
  load through the balancer, returns finite data: a typo in a metric or label name cannot pass.
- A session created through the balancer continues correctly while requests alternate between replicas,
  and stopping one replica mid-conversation loses no session.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import subprocess
import time

import httpx
import pytest
import yaml

from tests.helpers import ServerProcess, free_port, require_program, start_redis

from .test_compose import DOCKER, REPLICAS, dashboard_exprs

pytestmark = pytest.mark.slow
RATE_WINDOW = "1m"  # what Grafana's $__rate_interval becomes for these queries


def wait_for(url: str, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} did not answer 200 at {url}")


def haproxy_config(port: int, replica_ports: dict[str, int]) -> str:
    config = (DOCKER / "haproxy.cfg").read_text()
    config = re.sub(r"^(\s*bind\s+):8000\s*$", rf"\g<1>127.0.0.1:{port}", config, flags=re.M)
    for name, replica_port in replica_ports.items():
        config = re.sub(rf"^(\s*server\s+{name}\s+){name}:8000", rf"\g<1>127.0.0.1:{replica_port}", config, flags=re.M)
    assert config.count("127.0.0.1") == 1 + len(replica_ports)
    return config


def prometheus_config(replica_ports: dict[str, int]) -> str:
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            group["targets"] = [f"127.0.0.1:{replica_ports[t.split(':')[0]]}" for t in group["targets"]]
    return yaml.safe_dump(config)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, tmp_path_factory):
    for program in ("haproxy", "prometheus"):
        require_program(program, program)
    directory = tmp_path_factory.mktemp("stack")
    redis_url, redis = start_redis(directory)
    replicas = {name: ServerProcess(tiny_checkpoint, directory / f"{name}.log", "--num-slots", "8",
                                    env={"LINSERVE_SESSION_STORE": redis_url}) for name in REPLICAS}
    lb_port, prometheus_port = free_port(), free_port()
    (directory / "haproxy.cfg").write_text(haproxy_config(lb_port, {n: r.port for n, r in replicas.items()}))
    (directory / "prometheus.yml").write_text(prometheus_config({n: r.port for n, r in replicas.items()}))
    haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(directory / "haproxy.cfg")],
                               stdout=open(directory / "haproxy.log", "w"), stderr=subprocess.STDOUT)
    prometheus = subprocess.Popen(["prometheus", f"--config.file={directory / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={directory / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                  stdout=open(directory / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        lb, prom = f"http://127.0.0.1:{lb_port}", f"http://127.0.0.1:{prometheus_port}"
        wait_for(lb + "/ready", "haproxy")
        wait_for(prom + "/-/ready", "prometheus")
        yield {"lb": lb, "prometheus": prom, "replicas": replicas, "dir": directory}
    finally:
        for process in (haproxy, prometheus):
            process.terminate()
            process.wait(20)
        for replica in replicas.values():
            replica.stop()
        redis.kill()
        redis.wait(10)


def load(lb: str, seconds: float) -> int:
    """Streams, sessions and repeated prompts (prefix-cache hits) through the balancer, 4 clients at once."""
    def client(worker: int) -> int:
        done, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            body = {"prompt": "ROMEO. What light through yonder window breaks? " * 8, "max_tokens": 48,
                    "stream": True, "ignore_eos": True, "temperature": 0.8, "seed": done}
            with httpx.stream("POST", f"{lb}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                response.read()
            session = httpx.post(f"{lb}/v1/sessions", json={"prompt": f"worker {worker}"}, timeout=60).json()["id"]
            assert (
                httpx.post(f"{lb}/v1/sessions/{session}/completions", json={"max_tokens": 8}, timeout=60).status_code
                == 200
            )
            done += 1
        return done

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return sum(pool.map(client, range(4)))


def test_every_dashboard_query_returns_data_from_real_prometheus(stack):
    started = time.time()
    assert load(stack["lb"], seconds=14) > 0
    interval = float(yaml.safe_load((DOCKER / "prometheus.yml").read_text())["global"]["scrape_interval"].rstrip("s"))
    time.sleep(interval + 1)  # one more scrape after the load
    shown = {}
    for expr in dashboard_exprs():
        query = expr.replace("$__rate_interval", RATE_WINDOW)
        answer = httpx.get(f"{stack['prometheus']}/api/v1/query", params={"query": query}, timeout=10).json()
        assert answer["status"] == "success", (query, answer)
        values = [float(series["value"][1]) for series in answer["data"]["result"]]
        assert values and any(math.isfinite(v) for v in values), f"no data for {query}"
        shown[expr] = {
            json.dumps(series["metric"], sort_keys=True): series["value"][1] for series in answer["data"]["result"]
        }
    targets = httpx.get(f"{stack['prometheus']}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert len(targets) == len(REPLICAS) and {t["health"] for t in targets} == {"up"}
    (stack["dir"] / "dashboard_values.json").write_text(json.dumps(shown, indent=1))  # for the record
    print(f"\ndashboard values after {time.time() - started:.0f} s of load:\n{json.dumps(shown, indent=1)}")


def served_counts(replicas) -> dict[str, float]:
    """Session completions each replica answered (from its own /metrics)."""
    counts = {}
    for name, replica in replicas.items():
        text = httpx.get(f"{replica.base}/metrics", timeout=5).text
        counts[name] = sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("linserve_requests_total{")
            and "/completions" in line
            and "sessions" in line
            and 'status="200"' in line
        )
    return counts


def converse(base: str, session: str, turns: range) -> list[str]:
    """Turns as a careful client sends them: each with its own Idempotency-Key (so the balancer may resend a
    turn that met a draining replica, and a resent turn is applied once)."""
    texts = []
    for turn in turns:
        response = httpx.post(
            f"{base}/v1/sessions/{session}/completions",
            timeout=60,
            headers={"Idempotency-Key": f"{session}-turn-{turn}"},
            json={"prompt": f" Turn {turn}:", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def test_sessions_stay_on_one_replica_and_survive_losing_it(stack):
    """Issue 31: the balancer hashes on the session id, so each session's turns land on one replica (both
    replicas get sessions); stopping a replica mid-conversation moves its sessions to the other, nothing lost."""
    lb, replicas = stack["lb"], stack["replicas"]
    first, second = (replicas[name] for name in REPLICAS)
    # the reference: the same conversation on one replica directly
    reference = httpx.post(f"{first.base}/v1/sessions", json={"prompt": "JULIET."}).json()["id"]
    expected = converse(first.base, reference, range(10))
    sessions, homes = [], {}
    while len(set(homes.values())) < len(REPLICAS):  # sessions until each replica is some session's home
        assert len(sessions) < 16, f"16 sessions all hashed to one replica: {homes}"
        session = httpx.post(f"{lb}/v1/sessions", json={"prompt": "JULIET."}).json()["id"]
        before = served_counts(replicas)
        assert converse(lb, session, range(6)) == expected[:6]
        after = served_counts(replicas)
        served = {name: after[name] - before[name] for name in REPLICAS}
        assert sorted(served.values()) == [0, 6], served  # all six turns on one replica
        sessions.append(session)
        homes[session] = max(served, key=served.get)
    for session in sessions:  # still at home
        before = served_counts(replicas)
        assert converse(lb, session, range(6, 7)) == expected[6:7]
        after = served_counts(replicas)
        assert after[homes[session]] - before[homes[session]] == 1
    second.stop()  # SIGTERM mid-conversation; haproxy has not noticed yet: its retries move the requests
    for session in sessions:
        assert converse(lb, session, range(7, 10)) == expected[7:]
    listed = {s["id"] for s in httpx.get(f"{lb}/v1/sessions", params={"limit": 100}).json()["data"]}
    assert set(sessions) | {reference} <= listed
