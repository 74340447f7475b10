"""The engine core in a process of its own (`--api-servers 1`), end to end: the same tokens as the in-process
engine for every kind of request that crosses the boundary (streams, n rows, logprobs, structured outputs,
sessions and their commands), a client that leaves frees its slot, /ready, /version and /metrics answer from
the core, SIGTERM drains through it, and a core that dies turns /health to 503 and ends the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, assert_json_schema_answer

pytestmark = pytest.mark.slow

REQUESTS = [
    {"prompt": "ROMEO.", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": "To be", "max_tokens": 16, "temperature": 0.9, "top_p": 0.8, "seed": 7, "n": 2, "logprobs": 3},
    {"prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 1},
    {"prompt": "HAMLET.", "max_tokens": 12, "temperature": 1.0, "seed": 3, "stop": ["\n\n"],
     "presence_penalty": 0.5, "logit_bias": {"11": -100}},
]


@pytest.fixture(scope="module")
def split(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("split") / "serve.log", "--num-slots", "8",
                            "--api-servers", "1")
    yield process
    process.stop()


def core_pid(server: ServerProcess) -> int:
    """The engine core: the serve process's child that multiprocessing spawned (not its resource tracker)."""
    children = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and parent(int(pid)) == server.process.pid]
    cores = [pid for pid in children if "multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()]
    assert len(cores) == 1, children
    return cores[0]


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_metric(base: str, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(base, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def streamed(base: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def answers(base: str) -> list:
    got = []
    for body in REQUESTS:
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        got.append([(c["text"], c["finish_reason"], c["logprobs"]) for c in reply.json()["choices"]])
    got.append("".join(c["choices"][0]["text"] for c in streamed(base, REQUESTS[0])))
    sid = httpx.post(f"{base}/v1/sessions", json={"prompt": "KING."}).json()["id"]
    turn = {"prompt": " My lord", "max_tokens": 10, "temperature": 0}
    got.append(httpx.post(f"{base}/v1/sessions/{sid}/completions", json=turn).json()["choices"][0]["text"])
    fork = httpx.post(f"{base}/v1/sessions/{sid}/fork").json()["id"]
    exported = httpx.get(f"{base}/v1/sessions/{sid}/state").content
    imported = httpx.post(f"{base}/v1/sessions/import", content=exported,
                          headers={"content-type": "application/octet-stream"}).json()["id"]
    for other in (sid, fork, imported):  # the same history: the same next turn
        got.append(httpx.post(f"{base}/v1/sessions/{other}/completions", json=turn).json()["choices"][0]["text"])
    got.append([t["tokens"] for t in httpx.get(f"{base}/v1/sessions/{sid}/turns").json()])
    rewound = httpx.post(f"{base}/v1/sessions/{sid}/rewind", json={"turn": 1})
    assert rewound.status_code == 200, rewound.text
    got.append(httpx.post(f"{base}/v1/sessions/{sid}/completions", json=turn).json()["choices"][0]["text"])
    for other in (sid, fork, imported):
        assert httpx.delete(f"{base}/v1/sessions/{other}").status_code == 204
    assert httpx.get(f"{base}/v1/sessions/{sid}").status_code == 404
    return got


def test_the_core_process_serves_the_tokens_the_in_process_engine_does(split, server):
    """`server`: the suite's in-process server of the same checkpoint and settings."""
    assert core_pid(split) != split.process.pid
    assert answers(split.base) == answers(server["base"])
    assert_json_schema_answer(split.base)  # grammars compile in the frontend, masks apply in the core
    ready = httpx.get(f"{split.base}/ready").json()
    assert ready["session_store"]["up"] and ready["decode_step"]["status"] == "eager"
    version = httpx.get(f"{split.base}/version").json()
    assert version["projections"] == httpx.get(f"{server['base']}/version").json()["projections"]
    card = httpx.get(f"{split.base}/v1/models").json()["data"][0]
    assert card["state_bytes"] == httpx.get(f"{server['base']}/v1/models").json()["data"][0]["state_bytes"]


def test_per_step_stats_reach_the_frontends_metrics_and_a_client_that_leaves_frees_its_row(split):
    before = metric(split.base, 'linserve_inter_token_latency_seconds_count{context="0-1k"}')
    chunks = streamed(split.base, {"prompt": "ROMEO.", "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert len(chunks) == 30
    after = metric(split.base, 'linserve_inter_token_latency_seconds_count{context="0-1k"}')
    assert after - before >= 29  # every token's gap, observed in the core, counted by the frontend
    body = json.dumps({"prompt": "ROMEO.", "max_tokens": 100_000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", split.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b"data:" not in received:  # its first token
        received += sock.recv(65536)
    wait_for_metric(split.base, "linserve_requests_running", 1)  # (its step's stats follow its first token)
    sock.close()
    wait_for_metric(split.base, "linserve_requests_running", 0)  # the left stream ended in the core
    assert metric(split.base, 'linserve_state_pool_bytes{kind="in_use"}') == 0


def test_sigterm_drains_through_the_core(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--api-servers", "1")
    core = core_pid(server)
    sid = httpx.post(f"{server.base}/v1/sessions", json={"prompt": "KING."}).json()["id"]
    with httpx.stream("POST", f"{server.base}/v1/completions", timeout=60, json={
            "prompt": "ROMEO.", "max_tokens": 100_000, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.process.send_signal(signal.SIGTERM)
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
    assert last["choices"][0]["finish_reason"] == "abort"
    assert server.process.wait(30) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal once it has drained)
    assert not Path(f"/proc/{core}").exists() or parent(core) != server.process.pid
    records = list((tmp_path / "sessions").glob("*.lsess")) + list((tmp_path / "sessions").glob("*/*.lsess"))
    assert any(sid in record.name for record in records)  # the store has it: a restart continues it


def test_a_core_that_dies_turns_health_to_503_and_ends_the_server(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--api-servers", "1")
    with httpx.stream("POST", f"{server.base}/v1/completions", timeout=60, json={
            "prompt": "ROMEO.", "max_tokens": 100_000, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(core_pid(server), signal.SIGKILL)
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
    assert last["error"]["code"] == "engine_error" and "restarting" in last["error"]["message"]  # as in one process
    assert server.process.wait(30) == 3  # ENGINE_DEAD_EXIT_STATUS: a supervisor restarts it
    assert "the engine core" in (tmp_path / "serve.log").read_text()


def test_a_core_that_cannot_start_says_why(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    with pytest.raises(RuntimeError) as error:
        ServerProcess(broken, tmp_path / "serve.log", "--api-servers", "1")
    assert "no_such_family" in str(error.value)
