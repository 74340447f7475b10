"""Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with the right status.

Anything a client sent that is wrong gets a 4xx saying what; a 500 means a bug in linserve.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...engine.types import EngineError

logger = logging.getLogger(__name__)

ENGINE_STATUS = {"invalid": 400, "not_found": 404, "busy": 409, "capacity": 429, "unavailable": 503, "dead": 503,
                 "store_unavailable": 503, "outcome_unknown": 503, "already_applied": 409, "revision_mismatch": 409,
                 "idempotency_key_reused": 422}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error",
               503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def from_engine_error(error: EngineError, retry_after_s: int) -> APIError:
    status = ENGINE_STATUS.get(error.kind, 400)
    headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
    return APIError(status, error.message, error.param, error.kind, headers)


UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _validation_param(error: dict) -> str | None:
    """The field path of a validation error, without pydantic's union-branch tags (`str`, `list[int]`,
    `function-after[…]`)."""
    location = []
    for part in error.get("loc", ()):
        if part in ("body", "query", "path"):
            continue
        if isinstance(part, str) and (part in UNION_TAGS or not part.isidentifier()):
            break
        location.append(str(part))
    return ".".join(location) or None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, error: EngineError) -> JSONResponse:
        mapped = from_engine_error(error, request.app.state.settings.retry_after_s)
        return error_response(mapped.status, mapped.message, mapped.param, mapped.code, mapped.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", None, "invalid_json")
        named = (first.get("ctx") or {}).get("param")  # a request-wide check that names its field itself
        if named:
            return error_response(400, first.get("msg", "invalid request"), named, first.get("type"))
        param = _validation_param(first)
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(error, "headers", None) or {})
        message = str(error.detail)
        if error.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = ", ".join(allowed_methods(request))
            message = f"method {request.method} is not allowed here; allowed: {headers['Allow']}"
        return error_response(error.status_code, message, None, None, headers or None)


HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (FastAPI keeps each router's routes apart, and Starlette
    names only the first partly matching route's methods): probe the router with each method."""
    return [method for method in HTTP_METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                   for route in request.app.router.routes)]


class ServerErrors:
    """ASGI middleware: an exception that escapes a route becomes an OpenAI-shaped 500 naming a request id
    (logged with its traceback) instead of a plain-text body and a dropped keep-alive connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - the last line of defence: a bug, answered in the API's shape
            request_id = scope.get("state", {}).get("request_id") or f"req-{uuid.uuid4().hex}"
            logger.exception("unhandled error in %s %s (%s)", scope.get("method"), scope.get("path"), request_id)
            if not started:
                response = error_response(500, f"internal server error (request id {request_id})",
                                          code="internal_error", headers={"X-Request-Id": request_id})
                await response(scope, receive, send)


class RequestBody:
    """ASGI middleware: the whole body is read before the app sees it — 413 over `max_bytes` (declared by
    Content-Length or counted while it streams in, chunked included), 408 if it has not fully arrived
    within `timeout_s` (a client that sends headers and part of a body is not held open) — then replayed
    to the app; later messages (the client's disconnect) pass straight through."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, received, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                response = error_response(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                          code="body_timeout", headers={"Connection": "close"})
                await response(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # gone before the body arrived: nobody to answer
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body exceeds {self.max_bytes} bytes", None, "body_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)
