"""Typed FastAPI dependencies: the engine, the tokenizer, the settings, the request limits, and the caller's
key."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request

from ...engine import heap
from ...engine.client import EngineClient
from ...settings import Settings
from .errors import APIError
from .limits import RequestLimits


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_tokenizer(request: Request):
    return request.app.state.tokenizer


def get_engine(request: Request) -> EngineClient:
    return request.app.state.engine


def get_limits(request: Request) -> RequestLimits:
    return request.app.state.limits


async def require_key(request: Request) -> str | None:
    """With API keys configured, `Authorization: Bearer KEY` is required; returns an owner id for the key."""
    keys = request.app.state.settings.api_keys
    if not keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # constant time: every key is compared in full, whether or not an earlier one matched
    matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return hashlib.sha256(token.encode()).hexdigest()[:32]


SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenizerDep = Annotated[object, Depends(get_tokenizer)]
EngineDep = Annotated[EngineClient, Depends(get_engine)]
LimitsDep = Annotated[RequestLimits, Depends(get_limits)]
Owner = Annotated[str | None, Depends(require_key)]


INLINE_TOKENIZE_CHARS = 2048  # longer prompts are tokenized on a worker thread, off the event loop

def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids via the Rust tokenizer (no per-token Python lists of masks). A multi-megabyte text costs
    ~130 bytes per character at its peak, and glibc keeps freed heap unless asked: trim after a big one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:  # encode_batch releases the GIL while it works (encode does not): the event loop keeps running
        ids = backend.encode_batch([text], add_special_tokens=False)[0].ids
    if len(text) >= heap.LARGE_TEXT_CHARS:
        heap.trim()
    return ids


async def encode_prompt(request: Request, prompt: str | list[int], allow_empty: bool,
                        starts: bool = False) -> list[int]:
    """Token ids of a prompt, within `max_prompt_tokens` (400 beyond: a text too long to be within the
    limit is refused by its byte length, before tokenizing). A text that `starts` a sequence (not a session's
    continuation) gets the tokenizer's `prompt_prefix` (its bos) unless it begins with it already; token ids
    are taken as given (the engine checks them against the vocabulary). An empty stateless prompt starts from
    end-of-text, as every training work did."""
    tokenizer, limits = request.app.state.tokenizer, get_limits(request)
    if isinstance(prompt, list):
        ids = list(prompt)
    else:
        limits.check_prompt_bytes(len(prompt.encode()), "prompt", "prompt")
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            ids = tokenize(tokenizer, prompt)
        else:
            ids = await asyncio.to_thread(tokenize, tokenizer, prompt)
        prefix = list(limits.prompt_prefix) if starts else []
        if prefix and ids[:len(prefix)] != prefix:
            ids = prefix + ids
    limits.check_prompt_tokens(len(ids))
    if not ids and not allow_empty:
        ids = [tokenizer.eos_token_id]
    return ids


def check_model(name: str | None, settings) -> None:
    """`model` omitted means the served model; naming another one is a 404, as OpenAI and vLLM answer."""
    if name is not None and name != settings.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                       f"{settings.served_model_name!r}", "model", code="model_not_found")
