from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings


@pytest.fixture
def make_client(tiny_checkpoint):
    clients = []

    def factory(**overrides) -> TestClient:
        base = dict(model=str(tiny_checkpoint), device="cpu", num_slots=8, max_prefill_chunk=16, max_batch_tokens=64)
        settings = Settings(**{**base, **overrides})
        client = TestClient(create_app(settings))
        client.__enter__()  # runs the lifespan: model, pool, engine thread
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client):
    return make_client()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LINSERVE_MAX_PREFILL_CHUNK": "16"}
    command = [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_checkpoint), "--port", str(port),
               "--device", "cpu", "--num-slots", "8", "--log-level", "warning"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"linserve serve exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    else:
        process.kill()
        raise RuntimeError(f"linserve serve did not become ready: {log.read_text()[-2000:]}")
    yield {"base": base, "port": port, "process": process, "log": log}
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
