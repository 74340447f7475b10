"""End to end against a real `linserve serve` process on 127.0.0.1 with a tiny model."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import require_program

pytestmark = pytest.mark.slow


def metric(base: str, line_prefix: str, default: float | None = None) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    if default is not None:
        return default
    raise AssertionError(f"{line_prefix} not in /metrics")


def raw_stream_request(port: int, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    return sock


def test_openai_client_completions_and_chat(server):
    from openai import OpenAI

    client = OpenAI(base_url=server["base"] + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="ROMEO.", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model, prompt="ROMEO.", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices)
    assert streamed == completion.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hail!"}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hail!"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content


def test_langchain_chat_model_invokes_streams_and_batches(server):
    """LangChain's ChatOpenAI — how many agent frameworks reach an OpenAI-compatible server — pointed at linserve:
    invoke, stream (the same text) and batch, with usage metadata."""
    from langchain_openai import ChatOpenAI

    model = httpx.get(server["base"] + "/v1/models").json()["data"][0]["id"]
    chat = ChatOpenAI(base_url=server["base"] + "/v1", api_key="unused", model=model, temperature=0,
                      max_tokens=6, extra_body={"ignore_eos": True}, stream_usage=True)
    reply = chat.invoke([("user", "Hail!")])
    assert reply.content and reply.usage_metadata["output_tokens"] == 6
    streamed = list(chat.stream([("user", "Hail!")]))
    assert "".join(chunk.content for chunk in streamed) == reply.content
    assert sum((chunk.usage_metadata or {}).get("output_tokens", 0) for chunk in streamed) == 6
    assert [r.content for r in chat.batch([[("user", "Hail!")], [("user", "Hail!")]])] == [reply.content] * 2


def dechunk(body: bytes) -> bytes:
    """Undo HTTP/1.1 chunked transfer encoding."""
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, body = out + body[:size], body[size + 2 :]
    return out


def test_raw_sse_arrives_incrementally_and_ends_with_done(server):
    sock = raw_stream_request(server["port"], {"prompt": "A", "max_tokens": 300, "stream": True, "temperature": 0,
                                               "ignore_eos": True})
    received, arrivals, started = b"", [], time.monotonic()
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
        arrivals.append((time.monotonic() - started, received.count(b"data: ")))
    sock.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"200 OK" in head.split(b"\r\n")[0] and b"text/event-stream" in head
    assert b"transfer-encoding: chunked" in head.lower()
    events = dechunk(body).decode().split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert len(events) > 300 // 2
    first_event_at = next(t for t, events in arrivals if events >= 1)
    total = arrivals[-1][0]
    assert len(arrivals) > 10, "events were buffered instead of streamed"
    assert first_event_at < total / 2


def test_session_create_continue_fork_export_import_delete(server):
    base = server["base"]
    with httpx.Client(base_url=base, timeout=30) as http:
        sid = http.post("/v1/sessions", json={"prompt": "KING.\nNow is the winter"}).json()["id"]
        greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        http.post(f"/v1/sessions/{sid}/completions", json={"prompt": " of", **greedy}).raise_for_status()
        fork = http.post(f"/v1/sessions/{sid}/fork").json()["id"]
        snapshot = http.get(f"/v1/sessions/{sid}/state").content
        imported = http.post("/v1/sessions/import", content=snapshot).json()["id"]
        texts = {
            s: http.post(f"/v1/sessions/{s}/completions", json={"prompt": " our", **greedy}).json()["choices"][0][
                "text"
            ]
            for s in (sid, fork, imported)
        }
        assert len(set(texts.values())) == 1
        for s in (sid, fork, imported):
            assert http.delete(f"/v1/sessions/{s}").status_code == 204
            assert http.get(f"/v1/sessions/{s}").status_code == 404


@pytest.mark.parametrize("prompt", ["B", ["B", "C", "D"]], ids=["one prompt", "a batch"])
def test_client_disconnect_mid_stream_frees_the_slot(server, prompt):
    base = server["base"]
    requests = 1 if isinstance(prompt, str) else len(prompt)
    aborted_before = metric(base, 'linserve_requests_finished_total{reason="abort"}', default=0.0)
    sock = raw_stream_request(
        server["port"], {"prompt": prompt, "max_tokens": 1_000_000, "stream": True, "ignore_eos": True}
    )
    read_events(sock, 3 * requests)
    assert metric(base, "linserve_requests_running") == requests
    sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(base, "linserve_requests_running") != 0:
        time.sleep(0.05)
    assert metric(base, "linserve_requests_running") == 0
    assert metric(base, 'linserve_requests_finished_total{reason="abort"}') == aborted_before + requests
    assert metric(base, 'linserve_state_pool_bytes{kind="in_use"}') == 0  # no session is left either


def read_events(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        data += sock.recv(4096)
    return data


def test_busy_session_is_409(server):
    base = server["base"]
    sid = httpx.post(f"{base}/v1/sessions", json={"prompt": "x"}).json()["id"]
    payload = json.dumps({"prompt": "y", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=30)
    sock.sendall(
        f"POST /v1/sessions/{sid}/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    read_events(sock, 2)
    busy = httpx.post(f"{base}/v1/sessions/{sid}/completions", json={"prompt": "z"})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "busy"
    assert httpx.post(f"{base}/v1/sessions/{sid}/fork").status_code == 409
    assert httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 409
    sock.close()
    deadline = time.monotonic() + 10
    while httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.05)  # the disconnect aborts the generation; then the session is free again
    assert httpx.get(f"{base}/v1/sessions/{sid}").status_code == 404


def test_full_queue_is_429_with_retry_after(start_server):
    small = start_server("--num-slots", "1", env={"LINSERVE_MAX_WAITING": "1"})
    body = {"prompt": "a", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True}
    running = raw_stream_request(small.port, body)
    read_events(running, 1)
    queued = raw_stream_request(small.port, body)  # waits for the only slot
    deadline = time.monotonic() + 10
    while metric(small.base, "linserve_requests_waiting") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    rejected = httpx.post(f"{small.base}/v1/completions", json={"prompt": "c", "max_tokens": 1})
    assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    running.close()
    queued.close()
    deadline = time.monotonic() + 10
    while metric(small.base, "linserve_requests_running") + metric(small.base, "linserve_requests_waiting") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # a batch that does not fit (one slot, one waiting place): a later prompt is refused, and those accepted
    # before it (one or two, as the engine admitted the first to the slot or not yet) are aborted
    aborted = metric(small.base, 'linserve_requests_finished_total{reason="abort"}')
    batch = httpx.post(f"{small.base}/v1/completions", json={**body, "stream": False, "prompt": ["a", "b", "c"]})
    assert batch.status_code == 429
    while metric(small.base, "linserve_requests_running") + metric(small.base, "linserve_requests_waiting") > 0:
        assert time.monotonic() < deadline + 10, "the accepted prompts of a refused batch kept running"
        time.sleep(0.05)
    assert metric(small.base, 'linserve_requests_finished_total{reason="abort"}') in (aborted + 1, aborted + 2)


def test_metrics_pass_promtool(server, tmp_path):
    promtool = require_program("promtool", "prometheus")
    httpx.post(f"{server['base']}/v1/completions", json={"prompt": "x", "max_tokens": 3}).raise_for_status()
    text = httpx.get(f"{server['base']}/metrics").text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sigterm_ends_running_streams_with_abort(server):
    sock = raw_stream_request(
        server["port"], {"prompt": "C", "max_tokens": 1_000_000, "stream": True, "ignore_eos": True}
    )
    data = b""
    while data.count(b"data: ") < 2:
        data += sock.recv(4096)
    server["process"].send_signal(signal.SIGTERM)
    sock.settimeout(20)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    assert b'"finish_reason":"abort"' in data
    # uvicorn finishes its graceful shutdown, then re-raises the signal it caught (exit status -SIGTERM)
    assert server["process"].wait(20) in (0, -signal.SIGTERM)
    assert "Traceback" not in server["log"].read_text()


def test_ctrl_c_on_an_idle_server_exits_at_once_with_status_0(start_server):
    """SIGINT (Ctrl-C): a clean shutdown — status 0, no KeyboardInterrupt traceback — and no seconds spent
    tearing down the interpreter's heap afterwards (the wait below is a hang guard, not a timing claim)."""
    served = start_server("--num-slots", "2", "--log-level", "info")
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(10) == 0
    log = served.log.read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "Finished server process" in log


def test_a_compiled_server_reports_progress_and_streams_the_same_tokens(start_server, compile_cache):
    """`--compile on`: ready at once (eager), /ready shows the buckets compiling, then the same text as eager."""
    body = {"prompt": "ROMEO.", "max_tokens": 40, "temperature": 0.8, "ignore_eos": True}
    eager = start_server("--num-slots", "2")
    assert httpx.get(f"{eager['base']}/ready").json()["decode_step"]["status"] == "eager"
    want = [
        httpx.post(f"{eager['base']}/v1/completions", json={**body, "seed": s}, timeout=60).json()["choices"][0]["text"]
        for s in (0, 1)
    ]
    assert want[0] != want[1]  # seeded sampling: two different texts
    eager.stop()
    # one slot, one bucket: every bucket size and padding is tested in process (test_compiled_decode.py)
    compiled = start_server(
        "--num-slots", "1", "--compile", "on", "--no-compile-autotune",
        env={"LINSERVE_COMPILE_CACHE_DIR": compile_cache},
    )
    step = httpx.get(f"{compiled['base']}/ready").json()["decode_step"]
    assert step["compile"] == "on" and step["buckets"] == [1] and step["status"] in ("pending", "compiling", "compiled")
    deadline = time.monotonic() + 400
    while step["status"] != "compiled" and time.monotonic() < deadline:
        assert step["status"] in ("pending", "compiling"), step  # never failed
        time.sleep(1)
        step = httpx.get(f"{compiled['base']}/ready").json()["decode_step"]
    assert step["ready"] == [1], step
    assert (
        httpx.post(f"{compiled['base']}/v1/completions", json={**body, "seed": 0}, timeout=60).json()["choices"][0][
            "text"
        ]
        == want[0]
    )
    with httpx.Client(timeout=60) as client:  # two at once: the second waits for the slot
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(
                pool.map(
                    lambda s: client.post(f"{compiled['base']}/v1/completions", json={**body, "seed": s}).json()[
                        "choices"
                    ][0]["text"],
                    (0, 1),
                )
            )
    assert texts == want
    assert any(path.is_file() for path in Path(compile_cache).rglob("*"))


def test_logs_have_one_format_and_an_access_line_per_request(start_server):
    """uvicorn's lines and linserve's share one format; each request logs its id, never its key or prompt."""
    served = start_server("--num-slots", "2", "--log-level", "info", "--api-key", "sekrit-key")
    headers = {"Authorization": "Bearer sekrit-key", "X-Request-Id": "client-chosen-7"}
    response = httpx.post(
        f"{served['base']}/v1/completions",
        headers=headers,
        json={"prompt": "PROMPT-SHOULD-NOT-BE-LOGGED", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-chosen-7"
    own = httpx.get(f"{served['base']}/health").headers["x-request-id"]
    served.stop()
    lines = [line for line in served.log.read_text().splitlines() if line.strip()]
    pattern = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
    assert lines and all(pattern.match(line) for line in lines), [bad for bad in lines if not pattern.match(bad)][:3]
    assert any(" uvicorn: Started server process" in line for line in lines)  # uvicorn's own, same format
    assert not any("uvicorn.error" in line for line in lines)  # named for what they are: not errors
    access = [line for line in lines if " linserve.access: " in line]
    assert any('"POST /v1/completions" 200' in line and line.endswith("client-chosen-7") for line in access)
    assert any('"GET /health" 200' in line and line.endswith(own) for line in access)
    text = served.log.read_text()
    assert "sekrit-key" not in text and "PROMPT-SHOULD-NOT-BE-LOGGED" not in text


def test_dtype_auto_serves_bf16_where_the_cpu_computes_it(start_server):
    """`dtype` defaults to auto: bf16 decode weights on a CPU with bf16 in hardware, else fp32 (prefill runs fp32
    weights on a CPU either way); the (S, z) state stays fp32 either way. The server says which in /version and
    serves greedy text that repeats exactly."""
    import torch

    from linserve.model.loading import resolve_dtype
    from tests.devices import device_under_test

    server = start_server("--dtype", "auto", "--threads", "1")
    version = httpx.get(server.base + "/version").json()
    expected = str(resolve_dtype("auto", device_under_test())).removeprefix("torch.")
    assert version["dtype"] == expected and "prefill_dtype" not in version  # one dtype for every form
    assert version["cpu_threads"] == {**version["cpu_threads"], "threads": 1, "source": "setting"}
    body = {"prompt": "ROMEO.", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    first = httpx.post(server.base + "/v1/completions", json=body, timeout=60).json()
    again = httpx.post(server.base + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] == 12 and first["choices"][0]["text"] == again["choices"][0]["text"]
    created = httpx.post(server.base + "/v1/sessions", json={"prompt": "ROMEO."}, timeout=60).json()
    state = httpx.get(f"{server.base}/v1/sessions/{created['id']}/state", timeout=60)
    from safetensors.torch import load as load_safetensors

    tensors = load_safetensors(state.content)
    assert {t.dtype for name, t in tensors.items() if name.endswith((".S", ".z"))} == {torch.float32}
