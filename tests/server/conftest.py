from __future__ import annotations

import os
import shutil
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
from tests.devices import device_name_under_test


@pytest.fixture
def make_client(tiny_checkpoint, tmp_path):
    clients = []

    def factory(**overrides) -> TestClient:
        base = dict(model=str(tiny_checkpoint), device=device_name_under_test(), num_slots=8, max_prefill_chunk=16, max_batch_tokens=64,
                    session_store=f"dir:{tmp_path / f'sessions{len(clients)}'}", compile="off")  # compiled: test_e2e
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


class ServerProcess:
    """A real `linserve serve` on a free 127.0.0.1 port; stopped with SIGTERM."""

    def __init__(self, checkpoint, log_path, *extra: str, env: dict | None = None,
                 entry: tuple[str, ...] = ("-m", "server.cli"), prefix: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log_path
        # eager unless a test asks: compiling takes minutes of CPU (the compiled server has its own test)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LINSERVE_MAX_PREFILL_CHUNK": "16", "LINSERVE_COMPILE": "off",
               "LINSERVE_SESSION_STORE": f"dir:{log_path.parent / 'sessions'}", **(env or {})}
        command = [*prefix, sys.executable, *entry, "serve", "--model", str(checkpoint), "--port", str(self.port),
                   "--device", device_name_under_test(), "--log-level", "warning", *extra]
        with open(log_path, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"linserve serve exited: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        self.process.kill()
        raise RuntimeError(f"linserve serve did not become ready: {log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __getitem__(self, key: str):
        return getattr(self, key)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("serve") / "serve.log", "--num-slots", "8")
    yield process
    process.stop()


@pytest.fixture
def start_server(tiny_checkpoint, tmp_path):
    started = []

    def factory(*extra: str, env: dict | None = None) -> ServerProcess:
        process = ServerProcess(tiny_checkpoint, tmp_path / f"serve{len(started)}.log", *extra, env=env)
        started.append(process)
        return process

    yield factory
    for process in started:
        process.stop()


def start_redis(directory, port: int | None = None, durable: bool = False) -> tuple[str, subprocess.Popen]:
    """A real redis-server (Debian's package; `.ci/run` installs it) on 127.0.0.1 (a free port unless given):
    (url, process). `durable`: every write appended to its file and fsync'd, so it survives a SIGKILL."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is required (Debian package 'redis-server'; .ci/run installs it)"
    port = port or free_port()
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
                                "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0", process


@pytest.fixture
def redis_url(tmp_path):
    url, process = start_redis(tmp_path)
    yield url, process
    process.kill()
    process.wait(10)
