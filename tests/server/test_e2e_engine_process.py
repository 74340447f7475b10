"""The engine core in a process of its own (`--api-servers 1`, and 2 frontends sharing the port), end to end: the
same tokens as the in-process engine for every kind of request that crosses the boundary (streams, n rows,
logprobs, structured outputs, sessions and their commands), a client that leaves frees its slot, /ready,
/version and /metrics answer from the core (every frontend's counts in each), SIGTERM drains through it, and a
core that dies turns /health to 503 and ends the server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, assert_json_schema_answer, parent_pid, spawned_children

pytestmark = pytest.mark.slow

REQUESTS = [
    {"prompt": "ROMEO.", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": "To be", "max_tokens": 16, "temperature": 0.9, "top_p": 0.8, "seed": 7, "n": 2, "logprobs": 3},
    {"prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 1},
    {"prompt": "HAMLET.", "max_tokens": 12, "temperature": 1.0, "seed": 3, "stop": ["\n\n"],
     "presence_penalty": 0.5, "logit_bias": {"11": -100}},
]


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-frontend", "two-frontends"])
def split(tiny_checkpoint, tmp_path_factory, request):
    process = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("split") / "serve.log", "--num-slots", "8",
                            "--api-servers", request.param, "--log-level", "info")  # (access lines name a frontend)
    process.frontends = int(request.param)
    yield process
    process.stop()


def spawned(server: ServerProcess) -> list[int]:
    """The engine core, then (`--api-servers` N > 1) the N frontends."""
    return spawned_children(server.process.pid)


def core_pid(server: ServerProcess) -> int:
    processes = spawned(server)
    assert len(processes) == getattr(server, "frontends", 1) + (getattr(server, "frontends", 1) > 1), processes
    return processes[0]


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
    assert version["api_servers"] == split.frontends
    assert version["projections"] == httpx.get(f"{server['base']}/version").json()["projections"]
    card = httpx.get(f"{split.base}/v1/models").json()["data"][0]
    assert card["state_bytes"] == httpx.get(f"{server['base']}/v1/models").json()["data"][0]["state_bytes"]


def test_no_frontend_loads_torch_only_the_core_does(split):
    """engine/client.py: the HTTP side — `serve`'s process and each frontend — is typed against EngineClient, gets
    the core's tokenizer pickled and compiles grammars without torch, so none of them maps libtorch (~180 MB of
    RSS each), after completions, a session and a structured output; the core does (the check can see it)."""
    answers(split.base)
    assert_json_schema_answer(split.base)
    core, *frontends = spawned(split)
    for pid in (split.process.pid, *frontends):
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
    assert "libtorch" in Path(f"/proc/{core}/maps").read_text()
    card = httpx.get(f"{split.base}/v1/models").json()["data"][0]
    assert Path(card["root"]) == Path(split.checkpoint)  # the directory the core loaded, as it says


def nice_of(pid: int) -> int:
    """The nice value of `pid`'s main thread (/proc/PID/stat's 19th field)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def test_the_frontends_run_at_the_cores_priority_unless_frontend_nice_says(split, tiny_checkpoint, tmp_path):
    """`frontend_nice` 0 (the default): every process — the core and each frontend, one or several — at the priority
    `serve` started with; set (one frontend: `serve` itself), the serving process that many nice levels below the
    core, which keeps `serve`'s."""
    core, *frontends = spawned(split)
    for pid in (core, *frontends):
        assert nice_of(pid) == nice_of(split.process.pid), pid
    if frontends:
        return
    lowered = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--num-slots", "2", "--api-servers", "1",
                            "--frontend-nice", "7")
    try:
        core = spawned_children(lowered.process.pid)[0]
        assert nice_of(lowered.process.pid) == min(19, nice_of(core) + 7)
        assert nice_of(core) == nice_of(os.getpid())  # (the core kept the priority serve was started with)
        answer = httpx.post(f"{lowered.base}/v1/completions", json={"prompt": "To be", "max_tokens": 4})
        assert answer.status_code == 200, answer.text
    finally:
        lowered.stop()


def test_per_step_stats_reach_the_frontends_metrics_and_a_client_that_leaves_frees_its_row(split):
    before = metric(split.base, 'linserve_inter_token_latency_seconds_count{context="0-1k"}')
    chunks = streamed(split.base, {"prompt": "ROMEO.", "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert len(chunks) == 30
    after = metric(split.base, 'linserve_inter_token_latency_seconds_count{context="0-1k"}')
    assert after - before >= 29  # every token's gap, observed in the core, counted by the frontend
    # the core's thread counts in force and what other processes held, asked across the channel at scrape time
    assert metric(split.base, 'linserve_intra_op_threads{phase="decode"}') >= 1
    assert 0 <= metric(split.base, "linserve_cpu_others_held") <= os.cpu_count()
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


def test_prompts_larger_than_the_channels_buffers_cross_while_streams_flow_back(split):
    """The frontend's loop reads and writes the core's channel (engine_process/loop_link.py): requests of ~390 KB
    pickled each (130,000 ids ≥ 256: 3 bytes each; a socket pair's buffers take ~230 KB, so each is written in
    parts as the core reads it) sent while 8 streams' steps flow the other way — every one answered, nothing
    stuck."""
    import concurrent.futures

    def stream() -> int:
        return len(streamed(split.base, {"prompt": "ROMEO.", "max_tokens": 400, "temperature": 0.8, "seed": 1,
                                         "ignore_eos": True}))

    def large(number: int) -> dict:
        tokens = [256 + (number * 7 + i) % 700 for i in range(130_000)]  # (the test tokenizer's 1k vocabulary)
        response = httpx.post(f"{split.base}/v1/completions", timeout=120,
                              json={"prompt": tokens, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(stream) for _ in range(8)]
        larges = [pool.submit(large, number) for number in range(3)]
        assert [f.result(timeout=180) for f in streams] == [400] * 8
        assert [f.result(timeout=180)["prompt_tokens"] for f in larges] == [130_000] * 3
    wait_for_metric(split.base, "linserve_requests_running", 0)


@pytest.mark.parametrize("frontends", [1, 2])
def test_sigterm_drains_through_the_core(tiny_checkpoint, tmp_path, frontends):
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--api-servers", str(frontends))
    server.frontends = frontends
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
    assert not Path(f"/proc/{core}").exists() or parent_pid(core) != server.process.pid
    records = list((tmp_path / "sessions").glob("*.lsess")) + list((tmp_path / "sessions").glob("*/*.lsess"))
    assert any(sid in record.name for record in records)  # the store has it: a restart continues it


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_sigterm_while_the_core_checks_ends_the_start_and_leaves_no_process(tiny_checkpoint, tmp_path, frontends):
    """SIGTERM as soon as the core exists — during its start-up checks (its first seconds import torch), before
    `serve` starts any HTTP side: `serve` kills it and exits 0, no traceback, no process left behind."""
    import subprocess
    import sys

    from tests.devices import device_name_under_test

    command = [sys.executable, "-m", "linserve.server.cli", "serve", "--model", str(tiny_checkpoint), "--port", "0",
               "--device", device_name_under_test(), "--compile", "off", "--api-servers", frontends]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not spawned_children(process.pid):
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.01)
    core = spawned_children(process.pid)[0]
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode in (0, -signal.SIGTERM) and "Traceback" not in stderr, (process.returncode, stderr)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{core}").exists():  # (killed and reaped by serve, not orphaned)
        assert time.monotonic() < deadline, "the engine core outlived serve"
        time.sleep(0.05)


@pytest.mark.parametrize("frontends", [1, 2])
def test_a_core_that_dies_turns_health_to_503_and_ends_the_server(tiny_checkpoint, tmp_path, frontends):
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--api-servers", str(frontends))
    server.frontends = frontends
    with httpx.stream("POST", f"{server.base}/v1/completions", timeout=60, json={
            "prompt": "ROMEO.", "max_tokens": 100_000, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(core_pid(server), signal.SIGKILL)
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
    assert last["error"]["code"] == "engine_error" and "restarting" in last["error"]["message"]  # as in one process
    assert server.process.wait(30) == 3  # ENGINE_DEAD_EXIT_STATUS: a supervisor restarts it
    assert "the engine core" in (tmp_path / "serve.log").read_text()


def test_the_core_and_every_frontend_froze_startups_objects_out_of_the_collectors_walks(split):
    """engine/heap.py, in each process of a split server: its startup objects frozen (the count each logged)."""
    frozen = re.findall(r"(engine core|frontend): (\d+) objects made at startup frozen", split.log.read_text())
    assert sorted(who for who, _ in frozen) == ["engine core"] + ["frontend"] * split.frontends
    assert all(int(count) > 10_000 for _, count in frozen)


def test_every_frontend_answers_and_each_metrics_counts_them_all(split):
    """Requests on fresh connections land on either frontend (the kernel picks); whichever answers a scrape
    counts every one of them, and its process_* covers the whole server."""
    name = 'linserve_requests_total{endpoint="/v1/completions",status="200"}'

    def count() -> float:
        for line in httpx.get(f"{split.base}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    before, sent = count(), 0
    start = len(split.log.read_text())
    while sent < 12 or (split.frontends > 1 and not all(  # until each frontend has answered some of them
            f'[frontend {i}] linserve.access' in split.log.read_text()[start:] for i in (1, 2))):
        assert sent < 200, "one frontend answered 200 requests on fresh connections"
        reply = httpx.post(f"{split.base}/v1/completions", json={"prompt": "KING.", "max_tokens": 2, "seed": sent})
        assert reply.status_code == 200, reply.text
        sent += 1
    deadline = time.monotonic() + 10
    while count() != before + sent:  # (a frontend counts a request once its response is out)
        assert time.monotonic() < deadline, f"{name}: {count() - before} of {sent}"
        time.sleep(0.05)
    assert [count() - before for _ in range(8)] == [sent] * 8  # whichever frontend answers
    rss = metric(split.base, "process_resident_memory_bytes")
    core_rss = int(next(line for line in Path(f"/proc/{core_pid(split)}/status").read_text().splitlines()
                        if line.startswith("VmRSS:")).split()[1]) * 1024
    assert rss > core_rss  # the core's and the frontends' (and serve's) together


def test_a_killed_frontend_stops_the_server_and_every_turn_is_flushed(tiny_checkpoint, tmp_path):
    """`--api-servers 2`: one frontend SIGKILLed — the core aborts its requests, `serve` stops the other (its
    stream ends with `abort`), the core flushes the sessions, and `serve` exits 1 for a supervisor to restart."""
    server = ServerProcess(tiny_checkpoint, tmp_path / "serve.log", "--api-servers", "2")
    server.frontends = 2
    core, *frontends = spawned(server)
    sid = httpx.post(f"{server.base}/v1/sessions", json={"prompt": "KING."}).json()["id"]
    streams = []
    for _ in range(4):  # on either frontend
        body = json.dumps({"prompt": "ROMEO.", "max_tokens": 100_000, "ignore_eos": True, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        streams.append(sock)
    for sock in streams:
        received = b""
        while b"data:" not in received:
            received += sock.recv(65536)
    os.kill(frontends[0], signal.SIGKILL)
    assert server.process.wait(60) == 1, server.log.read_text()[-2000:]
    assert not Path(f"/proc/{core}").exists() or parent_pid(core) != server.process.pid
    for sock in streams:  # the killed frontend's connections are reset; the other's streams end with abort
        sock.settimeout(10)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except socket.timeout:
            raise AssertionError("a stream neither ended nor was closed") from None
        except OSError:  # reset
            pass
        sock.close()
        reasons = set(re.findall(rb'"finish_reason":"(\w+)"', data))
        assert reasons <= {b"abort"}, reasons
    records = list((tmp_path / "sessions").glob("*.lsess")) + list((tmp_path / "sessions").glob("*/*.lsess"))
    assert any(sid in record.name for record in records)  # flushed: a restart continues it
    assert "linserve-frontend-1 ended" in server.log.read_text() or "linserve-frontend-2 ended" in \
        server.log.read_text()


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_a_core_that_cannot_start_says_why(tiny_checkpoint, tmp_path, frontends):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    with pytest.raises(RuntimeError) as error:
        ServerProcess(broken, tmp_path / "serve.log", "--api-servers", frontends)
    assert "no_such_family" in str(error.value)
