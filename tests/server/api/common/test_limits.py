"""Each rule a request is checked against lives in one place (api/common/limits.py for the settings' limits, the
engine for the vocabulary): every family answers its own field's name, and nothing is left behind."""

from __future__ import annotations

import pytest

from tests.helpers import assert_slots_balance

LIMIT = 50


@pytest.fixture(scope="module")
def limited(tiny_checkpoint, tmp_path_factory):
    from fastapi.testclient import TestClient

    from linserve.server.app import create_app
    from linserve.server.settings import Settings
    from tests.devices import device_name_under_test

    settings = Settings(model=str(tiny_checkpoint), device=device_name_under_test(), num_slots=4, compile="off",
                        api_servers=0, max_tokens_limit=LIMIT, speculative_k=2,
                        session_store=f"dir:{tmp_path_factory.mktemp('limits')}")
    with TestClient(create_app(settings)) as client:
        yield client


def refused(response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": LIMIT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": LIMIT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": LIMIT + 1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                              "max_completion_tokens": LIMIT + 1}, "max_completion_tokens"),
    ("/v1/responses", {"input": "x", "max_output_tokens": LIMIT + 1}, "max_output_tokens"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, "priority"),
    ("/v1/responses", {"input": "x", "priority": 1}, "priority"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "speculative": {"method": "ngram",
                                                                                             "k": 3}}, "speculative"),
])
def test_each_family_names_its_own_field(limited, path, body, param):
    error = refused(limited.post(path, json=body), param)
    assert str(LIMIT) in error["message"] or param in ("priority", "speculative")
    assert assert_slots_balance(limited.app.state.engine)["slots_in_use"] == 0


def test_the_limit_itself_is_served(limited):
    body = {"prompt": "x", "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True}
    assert limited.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == LIMIT
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "ignore_eos": True}
    assert limited.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"] == 2


def test_token_ids_are_checked_once_by_the_engine_and_a_session_create_leaves_nothing(limited):
    vocab = len(limited.app.state.tokenizer)
    message = f"prompt token ids must be in [0, {vocab})"
    assert refused(limited.post("/v1/completions", json={"prompt": [1, vocab]}), "prompt")["message"] == (
        f"{message}: {vocab} is not")
    batch = {"prompt": [[1, 2], [3, vocab + 7]], "max_tokens": 2}  # the first prompt is accepted, then withdrawn
    assert refused(limited.post("/v1/completions", json=batch), "prompt")["message"] == (
        f"{message}: {vocab + 7} is not")
    session = limited.post("/v1/sessions", json={"prompt": [5, -1]})
    assert refused(session, "prompt")["message"] == f"{message}: -1 is not"
    assert limited.app.state.engine.registry.by_id == {}  # checked before the session existed
    assert limited.get("/v1/sessions").json()["data"] == []
    accounting = assert_slots_balance(limited.app.state.engine)
    assert accounting["slots_in_use"] == 0 and accounting["live"] == 0
