"""The OpenAPI document says what the server does: errors as they are answered (400 for validation, not
FastAPI's 422; 401/404/408/409/413/429/503 per route), streamed and binary bodies with their media
types, and the limits that depend on the loaded model and the settings (vocabulary, max_tokens, n,
prompt length) as schema bounds."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ErrorResponse

DESCRIPTIONS = {
    400: "Invalid request: the message says what is wrong and `param` which field",
    401: "Missing or invalid API key",
    404: "Not found: no such session (or it belongs to another key), or `model` names a model not served here",
    408: "The request body did not arrive in time",
    409: "The session is busy with another generation, or it changed since `If-Match`'s revision "
         "(`revision_mismatch`), or this `Idempotency-Key` was applied and its result was not kept",
    413: "Request body too large",
    422: "This `Idempotency-Key` was used for another request (`idempotency_key_reused`)",
    429: "Queue or session limit reached; retry after `Retry-After` seconds",
    500: "The engine failed while serving this request (the message names the request id)",
    503: "Shutting down, the engine has failed, or the session store is unavailable (`store_unavailable`: nothing "
         "changed) or did not answer a write in time (`outcome_unknown`: retry with the same `Idempotency-Key`); "
         "retry after `Retry-After` seconds",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": DESCRIPTIONS[code]} for code in codes}


AUTH = (401, 503)
BODY = (400, 401, 408, 413, 429, 503)
GENERATION = (*BODY, 404, 500)  # 404: `model` names a model this server does not serve
SESSION = (401, 404, 409, 503)
OPERATIONAL_RESPONSES = errors(503)


def streamed(model) -> dict[int | str, dict[str, Any]]:
    """200: the JSON `model`, or with `stream: true` server-sent events (`data: {chunk}` … `data: [DONE]`)."""
    return {200: {"model": model, "description": "JSON, or server-sent events when `stream` is true",
                  "content": {"text/event-stream": {}}}}


BINARY = {"schema": {"type": "string", "format": "binary"}}


def _limits(app: FastAPI, vocab: int | None) -> dict[str, dict[str, int]]:
    """Bounds that only the loaded model and the settings know: property → {JSON-schema keyword: value}."""
    state, settings = app.state, app.state.settings
    engine = getattr(state, "engine", None)
    n_max = min(settings.max_n, engine.facts.reserved_slots) if engine is not None else settings.max_n
    limits = {"max_tokens": {"maximum": settings.max_tokens_limit},
              "max_completion_tokens": {"maximum": settings.max_tokens_limit},
              "n": {"maximum": n_max}}
    if vocab is not None:
        limits["top_k"] = {"maximum": vocab}
    return limits


def _bound_prompt(schema: dict, vocab: int | None, max_tokens: int, max_prompts: int | None) -> None:
    """A token-id list holds at most max_prompt_tokens ids in the vocabulary; a batch at most max_prompts prompts."""
    def bound_ids(option: dict) -> None:
        option["maxItems"] = max_tokens
        if vocab is not None:
            option["items"] = {"type": "integer", "minimum": 0, "maximum": vocab - 1}

    for option in schema.get("anyOf", []):
        if option.get("type") != "array":
            continue
        items = option.get("items", {})
        if items.get("type") == "integer":
            bound_ids(option)
        elif max_prompts is not None:  # a batch: of texts, or of token-id lists
            option["maxItems"] = max_prompts
            if items.get("type") == "array":
                bound_ids(items)


def document_errors(app: FastAPI) -> None:
    """Replace `app.openapi` with a generator of the document described above (built once, after load)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in document.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                generated = responses.get("422", {}).get("description") == "Validation Error"  # FastAPI's own
                if generated and responses.pop("422") is not None and "400" not in responses:
                    responses["400"] = {"description": DESCRIPTIONS[400], "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        schemas = document.get("components", {}).get("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        vocab = len(app.state.tokenizer) if getattr(app.state, "tokenizer", None) is not None else None
        limits = _limits(app, vocab)
        for name in ("CompletionRequest", "ChatCompletionRequest", "SessionCreateRequest"):
            properties = schemas.get(name, {}).get("properties", {})
            for field, bounds in limits.items():
                if field in properties:
                    _bound(properties[field], bounds)
            if "prompt" in properties:
                batch = app.state.settings.max_prompts_per_request if name == "CompletionRequest" else None
                _bound_prompt(properties["prompt"], vocab, app.state.settings.max_prompt_tokens, batch)
            if "stream_options" in properties:  # only together with stream: true
                schemas[name]["if"] = {"required": ["stream_options"],
                                       "properties": {"stream_options": {"not": {"type": "null"}}}}
                schemas[name]["then"] = {"required": ["stream"], "properties": {"stream": {"const": True}}}
        app.openapi_schema = document
        return document

    app.openapi = openapi


def _bound(schema: dict, bounds: dict[str, int]) -> None:
    """Tighten a property's schema (plain, or the non-null branch of an Optional)."""
    targets = [option for option in schema.get("anyOf", []) if option.get("type") == "integer"] or [schema]
    for target in targets:
        for keyword, value in bounds.items():
            current = target.get(keyword)
            target[keyword] = value if current is None else min(current, value)
