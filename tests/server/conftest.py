from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from linserve.server.app import create_app
from linserve.server.settings import Settings
from tests.devices import device_name_under_test
from tests.helpers import ServerProcess, start_redis


@pytest.fixture
def make_client(tiny_checkpoint, tmp_path):
    clients = []

    def factory(**overrides) -> TestClient:
        base = dict(
            model=str(tiny_checkpoint),
            device=device_name_under_test(),
            num_slots=8,
            max_prefill_chunk=16,
            max_batch_tokens=64,
            session_store=f"dir:{tmp_path / f'sessions{len(clients)}'}",
            compile="off",
            api_servers=0,  # white-box: the tests reach into app.state.engine (the real servers split it)
        )  # compiled: test_e2e
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


@pytest.fixture
def redis_url(tmp_path):
    url, process = start_redis(tmp_path)
    yield url, process
    process.kill()
    process.wait(10)
