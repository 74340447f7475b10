"""The Responses API: `POST /v1/responses` (streamed or not), `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`.

A stored response *is* a session turn: its id names the session and the turn (`resp_<session>_<turn>`), and the
response itself (its request, text, usage) is kept by the same store write as the turn — as the session's own
store entry for the conversation's whole life (removed and expiring with it, within `session_responses_mb`),
and the newest 16 in the session's record too (see sessions/records.py). So `previous_response_id` continues the
session's fixed-size state: the follow-up prefills only its new input, on any replica, after any restart. An
older response of a conversation that has moved on is branched from with a fork at its turn (while the session
keeps that turn's snapshot, `session_turns_kept`). `store: false` runs stateless, or in a fork that is deleted
afterwards. Rendering is common (common/chat.py); tool calls and structured output are common (tools.py, structured.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, BackgroundTasks, Query, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from ...engine.sessions.records import ENTRY_TEXT_CHARS
from ...engine.types import EngineError, Idempotency
from ..common.chat import chat_prompt
from ..common.dependencies import (
    EngineDep,
    Owner,
    SettingsDep,
    TokenizerDep,
    check_model,
    encode_prompt,
    get_engine,
    get_limits,
)
from ..common.errors import APIError, from_engine_error
from ..common.generation import collect, reserve_logprobs, start_generation
from ..common.openapi import GENERATION, SESSION, errors
from ..common.streaming import EventStreamResponse
from ..common.structured import with_grammar
from ..common.tools import EMPTY_PARAMETERS
from .events import ResponseEvents, response_object
from .protocol import RESPONSE_ID, MessageItem, ResponseCreateRequest

router = APIRouter(prefix="/v1/responses")
KEY_PREFIX = "response:"  # a stored response's key in its session's record (clients' keys are digests)
CLEANUP_WAIT_S = 30.0


def response_id(session_id: str | None, turn: int) -> str:
    """`resp_<the session's 32 hex digits>_<turn>`; a response that is not stored: random digits, turn 0."""
    if session_id is None:
        import uuid

        return f"resp_{uuid.uuid4().hex}_0"
    return f"resp_{session_id.removeprefix('sess-')}_{turn}"


def parse_response_id(value: str, param: str) -> tuple[str, int]:
    if not re.fullmatch(RESPONSE_ID, value):
        raise APIError(400, f"{param}: {value[:80]!r} is not a response id", param)
    digits, turn = value[len("resp_"):].split("_")
    if turn == "0":
        raise APIError(404, f"response {value!r} was not stored (store: false)", param, code="not_found")
    return f"sess-{digits}", int(turn)


async def engine_call(request: Request, future, param: str | None = None, missing: str | None = None):
    try:
        return await asyncio.wrap_future(future)
    except EngineError as error:
        if error.kind == "not_found" and missing is not None:
            why = error.message.removeprefix("not found")  # a conversation whose responses passed their budget
            raise APIError(404, missing + why, param, code="not_found") from None
        raise from_engine_error(error, request.app.state.settings.retry_after_s) from None


async def kept_response(request: Request, owner, value: str, param: str | None) -> tuple[str, int, dict]:
    """(session, turn, what its session keeps of it) of a stored response: 404 if unknown, deleted or forgotten."""
    session_id, turn = parse_response_id(value, param or "response_id")
    missing = f"response {value!r} was not found (deleted, or expired with its conversation)"
    kept = await engine_call(request, get_engine(request).sessions.kept_result(session_id, owner,
                                                                                      KEY_PREFIX + value),
                             param, missing)
    return session_id, turn, kept


@dataclass
class Placement:
    """Where a new response runs: its session (None: stateless), the turn it will be, and what it continues."""

    session_id: str | None
    turn: int  # 0: not stored
    expected_revision: str | None = None
    cached_tokens: int = 0  # the conversation's tokens already in the state (not read again)
    previous: dict | None = None  # the previous response's request, as kept
    made: bool = False  # a session made for this response: deleted if its turn fails (or, not stored, after it)


async def place(request: Request, owner, body: ResponseCreateRequest) -> Placement:
    sessions = get_engine(request).sessions
    if body.previous_response_id is None:
        if not body.store:
            return Placement(None, 0)
        info = await engine_call(request, sessions.create(owner, first_prompt=True))
        return Placement(info.id, 1, made=True)
    session_id, turn, kept = await kept_response(request, owner, body.previous_response_id, "previous_response_id")
    previous = kept["entry"]["result"].get("note") or {}
    if body.store and kept["turn_count"] == turn:  # the conversation's newest response: continue its state
        return Placement(session_id, turn + 1, kept["revision"], kept["tokens"], previous)
    try:  # an older response (or store: false): a fork at that turn
        info = await asyncio.wrap_future(sessions.fork(session_id, owner, turn))
    except EngineError as error:
        if error.kind == "turn_not_kept":
            raise APIError(400, f"previous_response_id: its conversation has moved on since, and the state after it "
                           f"is no longer kept (the newest session_turns_kept turns are): {error}",
                           "previous_response_id", code="response_not_continuable") from None
        raise from_engine_error(error, request.app.state.settings.retry_after_s) from None
    return Placement(info.id, 1 if body.store else 0, None, info.tokens, previous, made=True)


def tools_read(tools) -> list:
    """What the prompt shows of a request's tools (request models or a kept response's dicts)."""
    def fields(tool):
        tool = tool if isinstance(tool, dict) else tool.model_dump()
        return tool["name"], tool.get("description"), tool.get("parameters") or EMPTY_PARAMETERS
    return [fields(tool) for tool in tools or ()]


def listed_item(item) -> dict:
    """An input item as `input_items` lists it (a message's text as a content part, as OpenAI lists it)."""
    data = item.model_dump(exclude_none=True, by_alias=True)
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        data["content"] = [{"type": "output_text" if item.role == "assistant" else "input_text", "text": item.content}]
    return data


def request_note(body: ResponseCreateRequest, tools, cached_tokens: int) -> dict:
    """What a stored response keeps of its request (its input only while small enough to keep)."""
    note = {"input": [listed_item(item) for item in body.items],
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "previous_response_id": body.previous_response_id,
            "text": body.text.model_dump(exclude_none=True, by_alias=True) if body.text else None,
            "tools": [{**t.model_dump(exclude_none=True), "parameters": t.parameters or dict(EMPTY_PARAMETERS),
                       "strict": True} for t in body.tools or ()],  # every call is held to its schema
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(), "parallel_tool_calls": body.parallel_tool_calls,
            "metadata": (body.model_extra or {}).get("metadata") or {}, "cached_tokens": cached_tokens,
            "calls": None if tools is None else {"optional": tools.optional}}
    if len(json.dumps(note)) > ENTRY_TEXT_CHARS:
        note["input"], note["input_dropped"] = [], True
    return note


@router.post("", response_model=None, responses=errors(*GENERATION, 404))
async def create_response(request: Request, body: ResponseCreateRequest, settings: SettingsDep,
                          tokenizer: TokenizerDep, owner: Owner, background: BackgroundTasks):
    check_model(body.model, settings)
    tool_fields = body.tool_fields()
    tools = tool_fields.tool_spec()
    params = await with_grammar(request, body.structured(), body.to_sampling_params(get_limits(request)), tools)
    placement = await place(request, owner, body)
    try:
        offered = tool_fields.tool_definitions()
        if placement.previous is not None and tools_read(body.tools) == tools_read(placement.previous.get("tools")):
            offered = None  # the conversation's state has read them already
        text = await chat_prompt(request, body.messages(), tokenizer, offered)
        if placement.cached_tokens and not getattr(tokenizer, "chat_template", None):
            text = "\n\n" + text  # the turns of a conversation are separated as one rendering would
        prompt_ids = await encode_prompt(request, text, allow_empty=False, starts=not placement.cached_tokens)
        rid = response_id(placement.session_id if placement.turn else None, placement.turn)
        note = request_note(body, tools, placement.cached_tokens)
        key = Idempotency(KEY_PREFIX + rid, rid, int(time.time()), note, entry=True) if placement.turn else None
        reservation = reserve_logprobs(request, [prompt_ids], params, body.stream, background)
        generation = await start_generation(request, [prompt_ids], params, "resp", placement.session_id, owner, key,
                                            placement.expected_revision)
    except BaseException:
        forget_session(request, owner, placement, failed=True)
        raise
    generation.request_id = rid
    events = ResponseEvents(rid, generation, settings.served_model_name, note, tools)
    if body.stream:
        def after_stream() -> None:
            reservation.release()
            forget_session(request, owner, placement, failed=events.status not in ("completed", "incomplete"))

        return EventStreamResponse(events.stream(), background=BackgroundTask(after_stream))
    try:
        rows = await collect(request, generation)
    except BaseException:
        forget_session(request, owner, placement, failed=True)
        raise
    finally:
        reservation.release()
    forget_session(request, owner, placement, failed=rows is None)
    if rows is None:
        return None
    events.finish("".join(o.text for o in rows[0]), rows[0][-1].finish_reason)
    return JSONResponse(events.final())


def forget_session(request: Request, owner, placement: Placement, failed: bool) -> None:
    """A session made for this response goes again if its turn failed, or when the response is not stored."""
    if placement.made and (failed or not placement.turn):
        get_engine(request).sessions.abandon(placement.session_id, owner, wait_s=CLEANUP_WAIT_S)


@router.get("/{response_id}", response_model=None, responses=errors(*SESSION))
async def retrieve_response(request: Request, response_id: str, settings: SettingsDep, owner: Owner):
    _, _, kept = await kept_response(request, owner, response_id, None)
    result = kept["entry"]["result"]
    return JSONResponse(response_object(response_id, result, settings.served_model_name))


@router.delete("/{response_id}", response_model=None, responses=errors(*SESSION, 409))
async def delete_response(request: Request, engine: EngineDep, response_id: str, owner: Owner):
    """Forget a stored response (it can no longer be retrieved or continued from); its conversation's state and
    other responses stay."""
    session_id, _ = parse_response_id(response_id, "response_id")
    await engine_call(request, engine.sessions.forget(session_id, owner, KEY_PREFIX + response_id),
                      None, f"response {response_id!r} was not found")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/{response_id}/input_items", response_model=None, responses=errors(*SESSION))
async def input_items(request: Request, response_id: str, owner: Owner,
                      limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
                      order: Annotated[Literal["asc", "desc"], Query()] = "desc"):
    """The response's input items (what its request added to the conversation), newest first unless asc."""
    _, _, kept = await kept_response(request, owner, response_id, None)
    note = kept["entry"]["result"].get("note") or {}
    if note.get("input_dropped"):
        raise APIError(404, "this response's input was too large to keep", None, code="not_found")
    items = [{"id": item.get("id") or f"item_{response_id[5:]}_{index}", **item}
             for index, item in enumerate(note.get("input") or [])]
    if order == "desc":
        items.reverse()
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise APIError(400, f"after: {after!r} is not an item of this response", "after")
        items = items[position + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


