from __future__ import annotations

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
