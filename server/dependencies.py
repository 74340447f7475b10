"""Typed FastAPI dependencies: the engine, the tokenizer, the settings, and the caller's key."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import Depends, Request

from .errors import APIError
from .settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_tokenizer(request: Request):
    return request.app.state.tokenizer


async def require_key(request: Request) -> str | None:
    """With API keys configured, `Authorization: Bearer KEY` is required; returns an owner id for the key."""
    keys = request.app.state.settings.api_keys
    if not keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or token not in keys:
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return hashlib.sha256(token.encode()).hexdigest()[:32]


SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenizerDep = Annotated[object, Depends(get_tokenizer)]
Owner = Annotated[str | None, Depends(require_key)]


def encode_prompt(tokenizer, prompt: str | list[int], allow_empty: bool) -> list[int]:
    """Token ids of a prompt; an empty stateless prompt starts from end-of-text, as every training work did."""
    ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
    if not ids and not allow_empty:
        ids = [tokenizer.eos_token_id]
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids
