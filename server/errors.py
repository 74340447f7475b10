"""Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with the right status.

Anything a client sent that is wrong gets a 4xx saying what; a 500 means a bug in linserve.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .engine.types import EngineError

logger = logging.getLogger(__name__)

ENGINE_STATUS = {"invalid": 400, "not_found": 404, "busy": 409, "capacity": 429, "unavailable": 503}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


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


def _validation_param(error: dict) -> str | None:
    location = [str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path")]
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
        param = _validation_param(first)
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), None, None, getattr(error, "headers", None))


class BodySizeLimit:
    """ASGI middleware: 413 for a body over the limit, by Content-Length or while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise APIError(413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large")
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body exceeds {self.max_bytes} bytes", None, "body_too_large")
        await response(scope, receive, send)
