"""linserve's session API: a persistent, fixed-size state per conversation."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, BackgroundTasks, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.convertors import StringConvertor, register_url_convertor

from ...engine.client import EngineClient
from ...engine.sessions.stores import SESSION_ID, SESSION_ID_PATTERN
from ...engine.types import AlreadyApplied, EngineError, SamplingParams
from ..common.completion_protocol import CompletionRequest, CompletionResponse
from ..common.completion_serving import run_completion
from ..common.dependencies import EngineDep, Owner, SettingsDep, TokenizerDep, encode_prompt
from ..common.errors import from_engine_error
from ..common.generation import collect, start_generation
from ..common.openapi import AUTH, BINARY, BODY, GENERATION, SESSION, errors, streamed
from .idempotency import UNKNOWN, IdempotencyDep, IfMatch
from .protocol import (
    RewindRequest,
    SessionCreated,
    SessionCreateRequest,
    SessionDetail,
    SessionList,
    SessionRef,
    TurnInfo,
)


class SessionIdConvertor(StringConvertor):
    """Session ids look like `sess-…`: so `/v1/sessions/import` is never taken for a session id, and a
    path names exactly the methods documented for it."""

    regex = SESSION_ID_PATTERN


register_url_convertor("session_id", SessionIdConvertor())
router = APIRouter(prefix="/v1/sessions")
CLEANUP_WAIT_S = 30.0  # a failed create's session is deleted once its aborted prefill has settled


async def engine_call(request: Request, future):
    try:
        return await asyncio.wrap_future(future)
    except EngineError as error:
        raise from_engine_error(error, request.app.state.settings.retry_after_s) from None


def replayed(status: int, body: object) -> Response:
    """The answer a key got the first time (see idempotency.py)."""
    headers = {"Idempotent-Replayed": "true"}
    if body is None:
        return Response(status_code=status, headers=headers)
    return JSONResponse(body, status_code=status, headers=headers)


async def replay_made(request: Request, engine: EngineClient, owner: Owner, idempotency) -> Response | None:
    """A create, fork or import this key already made: its first answer, while the session it made exists (one
    deleted since is not made again by a replay: the key applies anew)."""
    recent = request.app.state.recent_results
    earlier = await recent.get(engine, idempotency)
    if earlier is None:
        return None
    try:
        await asyncio.wrap_future(engine.sessions.info(earlier[1]["id"], owner))
    except EngineError as error:
        if error.kind != "not_found":
            raise from_engine_error(error, request.app.state.settings.retry_after_s) from None
        recent.forget(idempotency)
        return None
    return replayed(*earlier)


@router.post("", response_model=SessionCreated, responses=errors(*GENERATION, 422))
async def create_session(request: Request, engine: EngineDep, owner: Owner, idempotency: IdempotencyDep,
                         body: SessionCreateRequest | None = None) -> SessionCreated:
    """The prompt is checked before the session exists, and the session is deleted again if its prefill
    fails or the client leaves: no failure path leaves a session (and its slot) behind."""
    recent = request.app.state.recent_results
    if (earlier := await replay_made(request, engine, owner, idempotency)) is not None:
        return earlier
    created = await _create(request, engine, owner, body)
    if created is not None:
        await recent.put(engine, idempotency, 200, created.model_dump())
    return created


async def _create(request: Request, engine: EngineClient, owner: Owner,
                  body: SessionCreateRequest | None) -> SessionCreated | None:
    prompt_ids = await encode_prompt(request, body.prompt, allow_empty=True, starts=True) if body else []
    # with a prompt, one write: the prompt's turn stores the new session (a failed prefill or write leaves none)
    info = await engine_call(request, engine.sessions.create(owner, bool(prompt_ids), prompt_ids))
    if not prompt_ids:
        return SessionCreated(id=info.id, tokens=info.tokens, state_bytes=info.state_bytes, revision=info.revision)
    done = False
    try:
        generation = await start_generation(request, [prompt_ids], SamplingParams(max_tokens=0), "sess", info.id, owner)
        if await collect(request, generation) is None:
            return None
        info = await engine_call(request, engine.sessions.info(info.id, owner, here=True))  # (just stored)
        done = True
    finally:
        if not done:  # waits for the aborted prefill's turn to settle (milliseconds), then deletes
            engine.sessions.abandon(info.id, owner, wait_s=CLEANUP_WAIT_S)
    return SessionCreated(id=info.id, tokens=info.tokens, state_bytes=info.state_bytes, revision=info.revision)


MAX_PAGE = 100


@router.get("", response_model=SessionList, responses=errors(*AUTH, 400))
async def list_sessions(request: Request, engine: EngineDep, owner: Owner,
                        limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="sessions per page")] = 20,
                        after: Annotated[str | None, Query(description="the last id of the previous page",
                                                           pattern=f"^{SESSION_ID.pattern}$")] = None,
                        order: Annotated[Literal["desc", "asc"], Query(description="by creation time")] = "desc"
                        ) -> SessionList:
    """The caller's sessions (with API keys: the key's own), in every tier: device, host and store."""
    sessions, has_more = await engine_call(request, engine.sessions.list(owner, after, limit, order == "desc"))
    return SessionList(data=[SessionDetail(**info.__dict__) for info in sessions], has_more=has_more,
                       first_id=sessions[0].id if sessions else None, last_id=sessions[-1].id if sessions else None)


@router.post("/import", response_model=SessionRef, responses=errors(*BODY, 422),
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": BINARY},
                                            "description": "a snapshot from GET /v1/sessions/{id}/state"}})
async def import_session(request: Request, engine: EngineDep, owner: Owner, idempotency: IdempotencyDep) -> SessionRef:
    recent = request.app.state.recent_results
    if (earlier := await replay_made(request, engine, owner, idempotency)) is not None:
        return earlier
    data = await request.body()
    info = await engine_call(request, engine.sessions.import_(data, owner))
    await recent.put(engine, idempotency, 200, {"id": info.id})
    return SessionRef(id=info.id)


@router.get("/{session_id:session_id}", response_model=SessionDetail, responses=errors(*SESSION))
async def get_session(request: Request, engine: EngineDep, session_id: str, owner: Owner) -> SessionDetail:
    info = await engine_call(request, engine.sessions.info(session_id, owner))
    return SessionDetail(**info.__dict__)


@router.post("/{session_id:session_id}/completions", response_model=None,
             responses={**streamed(CompletionResponse), **errors(*GENERATION, 404, 409, 422)})
async def session_completions(request: Request, session_id: str, body: CompletionRequest, settings: SettingsDep,
                              tokenizer: TokenizerDep, owner: Owner, background: BackgroundTasks,
                              idempotency: IdempotencyDep, if_match: IfMatch):
    """With `Idempotency-Key`, the turn is applied at most once: a retry gets the first answer; with
    `If-Match: "<revision>"`, only if the session is still at that revision (else 409 naming the current one)."""
    return await run_completion(request, body, settings, tokenizer, owner, background, session_id, idempotency,
                                if_match)


@router.post("/{session_id:session_id}/fork", response_model=SessionRef, responses=errors(*SESSION, 400, 422, 429))
async def fork_session(request: Request, engine: EngineDep, session_id: str, owner: Owner,
                       idempotency: IdempotencyDep) -> SessionRef:
    recent = request.app.state.recent_results
    if (earlier := await replay_made(request, engine, owner, idempotency)) is not None:
        return earlier
    info = await engine_call(request, engine.sessions.fork(session_id, owner))
    await recent.put(engine, idempotency, 200, {"id": info.id})
    return SessionRef(id=info.id)


@router.get("/{session_id:session_id}/state", response_class=Response, responses={
    200: {"content": {"application/octet-stream": BINARY}, "description": "the session's safetensors snapshot"},
    **errors(*SESSION)})
async def export_session(request: Request, engine: EngineDep, session_id: str, owner: Owner) -> Response:
    data = await engine_call(request, engine.sessions.export(session_id, owner))
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{session_id}.safetensors"'})


@router.get("/{session_id:session_id}/turns", response_model=list[TurnInfo], responses=errors(*SESSION))
async def list_turns(request: Request, engine: EngineDep, session_id: str, owner: Owner) -> list[TurnInfo]:
    """The session's turns, oldest first: each kept snapshot (one the session can be rewound to) and each turn
    whose text the session keeps (`session_text_chars`: its prompt and completion; turn 0: text a fork or an
    import brought with it)."""
    turns, texts = await engine_call(request, engine.sessions.turns(session_id, owner))
    listed = [TurnInfo(turn=t["turn"], tokens=t["tokens"], created=t["created"], prompt=t["prompt"],
                       completion=t["completion"], rewindable=False) for t in texts]
    by_turn = {info.turn: info for info in listed if info.turn}
    for turn in turns:
        if turn.index in by_turn:
            by_turn[turn.index].rewindable = True
        else:
            listed.append(TurnInfo(turn=turn.index, tokens=turn.tokens, created=turn.created, rewindable=True))
    return sorted(listed, key=lambda info: info.turn)


@router.post("/{session_id:session_id}/rewind", response_model=SessionDetail, responses=errors(*BODY, 404, 409, 422))
async def rewind(request: Request, engine: EngineDep, session_id: str, body: RewindRequest, owner: Owner,
                 idempotency: IdempotencyDep) -> SessionDetail:
    """Make a kept turn the head again (later turns are dropped): regenerate or edit the last answer."""
    try:
        info = await asyncio.wrap_future(engine.sessions.rewind(session_id, owner, body.turn, idempotency))
    except AlreadyApplied as applied:  # the session as that rewind left it (tokens), as it is now otherwise
        info = await engine_call(request, engine.sessions.info(session_id, owner))
        detail = SessionDetail(**{**info.__dict__, **(applied.result or {})})
        return replayed(200, jsonable_encoder(detail))
    except EngineError as error:
        raise from_engine_error(error, request.app.state.settings.retry_after_s) from None
    return SessionDetail(**info.__dict__)


@router.delete("/{session_id:session_id}", status_code=204, response_class=Response,
                responses=errors(*SESSION, 400, 422))
async def delete_session(request: Request, engine: EngineDep, session_id: str, owner: Owner,
                         idempotency: IdempotencyDep) -> Response:
    """With `Idempotency-Key`, a retry of a delete answers 204 again — also after an `outcome_unknown`
    answer, when the session turns out to be gone (the first attempt landed)."""
    recent = request.app.state.recent_results
    earlier = await recent.get(engine, idempotency)
    if earlier is not None and earlier[0] == 204:
        return replayed(204, None)
    try:
        await asyncio.wrap_future(engine.sessions.delete(session_id, owner))
    except EngineError as error:
        if error.kind == "not_found" and earlier is not None:  # the delete whose outcome was unknown landed
            await recent.put(engine, idempotency, 204, None)
            return replayed(204, None)
        if error.kind == "outcome_unknown":
            await recent.put(engine, idempotency, UNKNOWN, None)
        raise from_engine_error(error, request.app.state.settings.retry_after_s) from None
    await recent.put(engine, idempotency, 204, None)
    return Response(status_code=204)
