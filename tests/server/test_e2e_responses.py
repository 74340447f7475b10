"""The Responses API through HTTP with the official `openai` client against a real `linserve serve` (a random-weight
tiny model, a `dir:` store): a stored response is a session turn, so `previous_response_id` continues its state —
the follow-up reads only its new input (usage's cached tokens, the prompt-token metric), a branch from an older
response gives what continuing it gave, a restart changes nothing; streamed events in OpenAI's order; tools,
`text.format`, delete, `store: false`, and the 4xx answers."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from pydantic import BaseModel

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "linserve-shakespeare"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-store")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, store):
    server = ServerProcess(tiny_checkpoint, store.parent / "responses.log", "--session-store", f"dir:{store}",
                           env={"LINSERVE_SESSION_TURNS_KEPT": "3"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def prompt_tokens_metric(server) -> float:
    text = httpx.get(f"{server.base}/metrics").text
    return float(re.search(r"^linserve_prompt_tokens_total (\S+)$", text, re.M).group(1))


def test_a_follow_up_reads_only_its_new_input(client, server):
    first = client.responses.create(input="Hail, fair Verona", instructions="Answer in verse.", **GREEDY)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens_details.cached_tokens == 0 and first.usage.output_tokens == 12
    before = prompt_tokens_metric(server)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == first.usage.total_tokens  # the whole conversation so far is in the state
    new = second.usage.input_tokens - cached
    turn = httpx.post(f"{server.base}/tokenize", json={"prompt": "\n\nUSER.\nAnd then?\n\nASSISTANT.\n"}).json()
    assert new == turn["count"] and prompt_tokens_metric(server) - before == new  # only the new turn was read
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.usage == second.usage
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "And then?")]


def test_a_branch_from_an_older_response_gives_what_continuing_it_gave(client):
    first = client.responses.create(input="ROMEO.", **GREEDY)
    head = client.responses.create(input="Speak again", previous_response_id=first.id, **GREEDY)
    client.responses.create(input="Further", previous_response_id=head.id, **GREEDY)  # the conversation moves on
    branch = client.responses.create(input="Speak again", previous_response_id=first.id, **GREEDY)
    assert branch.id != head.id and branch.output_text == head.output_text
    assert branch.usage == head.usage
    unstored = client.responses.create(input="Speak again", previous_response_id=first.id, store=False, **GREEDY)
    assert unstored.output_text == head.output_text and unstored.id.endswith("_0")
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(NotFoundError):
        client.responses.create(input="x", previous_response_id=unstored.id, **GREEDY)


def test_a_branch_past_the_kept_turns_is_a_400(client):
    first = client.responses.create(input="A", **GREEDY)
    latest = first
    for _ in range(4):  # LINSERVE_SESSION_TURNS_KEPT=3: turn 1's snapshot is dropped
        latest = client.responses.create(input="more", previous_response_id=latest.id, **GREEDY)
    with pytest.raises(BadRequestError) as refused:
        client.responses.create(input="again", previous_response_id=first.id, **GREEDY)
    assert refused.value.body["code"] == "response_not_continuable"
    assert client.responses.retrieve(first.id).id == first.id  # still retrievable


def test_streamed_events_come_in_order_and_add_up(client):
    first = client.responses.create(input="Once", **GREEDY)
    with client.responses.stream(input="Twice", previous_response_id=first.id, **GREEDY) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == client.responses.retrieve(final.id).output_text
    assert final.usage.input_tokens_details.cached_tokens == first.usage.total_tokens


def test_tool_calls_and_their_outputs_continue_the_state(client):
    called = client.responses.create(model=MODEL, input="Weather in Verona?", tools=TOOLS, tool_choice="required",
                                     max_output_tokens=60)
    assert called.status == "completed" and [o.type for o in called.output] == ["function_call"]
    call = called.output[0]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(model=MODEL, previous_response_id=called.id, tools=TOOLS, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny."}], max_output_tokens=8)
    assert answer.usage.input_tokens_details.cached_tokens == called.usage.total_tokens
    assert [o.type for o in answer.output] == ["message"]
    with client.responses.stream(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=60) as stream:
        final = stream.get_final_response()
    streamed = final.output[0]
    assert streamed.type == "function_call" and final.status == "completed"
    jsonschema.validate(json.loads(streamed.arguments), WEATHER)
    assert client.responses.retrieve(final.id).output[0].arguments == streamed.arguments


def test_text_format_and_parse(client):
    class Verdict(BaseModel):
        guilty: bool
        reason: str

    parsed = client.responses.parse(model=MODEL, input="Judge him.", text_format=Verdict, max_output_tokens=60)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Verdict)
    schema = {"type": "object", "properties": {"act": {"type": "integer"}}, "required": ["act"]}
    plain = client.responses.create(model=MODEL, input="Which act?", max_output_tokens=30,
                                    text={"format": {"type": "json_schema", "name": "act", "schema": schema}})
    jsonschema.validate(json.loads(plain.output_text), schema)


def test_bad_requests_are_4xx_naming_the_field(server):
    for body, status, param in [
        ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
        ({"input": "x", "previous_response_id": "resp_" + "0" * 32 + "_1"}, 404, "previous_response_id"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
        ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
         400, "response_format"),
        ({"input": "x", "model": "gpt-5"}, 404, "model"),
    ]:
        response = httpx.post(f"{server.base}/v1/responses", json={"max_output_tokens": 4, **body})
        assert response.status_code == status, (body, response.text)
        assert (response.json()["error"]["param"] or "").startswith(param), (body, response.json())
    assert httpx.get(f"{server.base}/v1/responses/resp_{'0' * 32}_1").status_code == 404
    assert httpx.get(f"{server.base}/v1/responses/nonsense").status_code == 400


def test_delete_and_restart(client, server, tiny_checkpoint, store):
    kept = client.responses.create(input="Remember me", **GREEDY)
    gone = client.responses.create(input="Forget me", previous_response_id=kept.id, **GREEDY)
    client.responses.delete(gone.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(NotFoundError):
        client.responses.create(input="x", previous_response_id=gone.id, **GREEDY)
    before = client.responses.create(input="After", previous_response_id=kept.id, store=False, **GREEDY)
    server.stop()  # the module's last test: a new process on the same store
    restarted = ServerProcess(tiny_checkpoint, store.parent / "restarted.log", "--session-store", f"dir:{store}")
    try:
        again = OpenAI(base_url=f"{restarted.base}/v1", api_key="unused", max_retries=0)
        assert again.responses.retrieve(kept.id).output_text == kept.output_text
        after = again.responses.create(input="After", previous_response_id=kept.id, store=False, **GREEDY)
        assert after.output_text == before.output_text  # the state came back exactly
        with pytest.raises(NotFoundError):
            again.responses.retrieve(gone.id)  # a delete is stored too
    finally:
        restarted.stop()
