"""Typed FastAPI dependencies: the engine, the tokenizer, the settings, and the caller's key."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request

from ...engine import heap
from ...settings import Settings
from .errors import APIError


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
    # constant time: every key is compared in full, whether or not an earlier one matched
    matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return hashlib.sha256(token.encode()).hexdigest()[:32]


SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenizerDep = Annotated[object, Depends(get_tokenizer)]
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


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any one token decodes to: a text of B bytes has at least B / this many tokens."""
    return max(len(tokenizer.decode([i]).encode()) for i in range(len(tokenizer)))


def prompt_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before a text that starts a sequence: [bos] where it adds one (Llama-style
    `add_bos_token`, as most fla checkpoints' tokenizers do), else none (the shipped byte-level BPE)."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids[:1] if ids and bos is not None and ids[0] == bos else []


async def encode_prompt(request: Request, prompt: str | list[int], allow_empty: bool,
                        starts: bool = False) -> list[int]:
    """Token ids of a prompt, within `max_prompt_tokens` (400 beyond: a text too long to be within the
    limit is refused by its byte length, before tokenizing). A text that `starts` a sequence (not a session's
    continuation) gets the tokenizer's `prompt_prefix` (its bos) unless it begins with it already; token ids
    are taken as given. An empty stateless prompt starts from end-of-text, as every training work did."""
    state = request.app.state
    tokenizer, limit = state.tokenizer, state.settings.max_prompt_tokens
    too_long = f"the prompt is longer than max_prompt_tokens ({limit} tokens)"
    if isinstance(prompt, list):
        ids = list(prompt)
    else:
        if len(prompt.encode()) > limit * state.max_token_bytes:
            raise APIError(400, too_long, "prompt", "prompt_too_long")
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            ids = tokenize(tokenizer, prompt)
        else:
            ids = await asyncio.to_thread(tokenize, tokenizer, prompt)
        prefix = state.prompt_prefix if starts else []
        if prefix and ids[:len(prefix)] != prefix:
            ids = prefix + ids
    if len(ids) > limit:
        raise APIError(400, f"{too_long}: it has {len(ids)}", "prompt", "prompt_too_long")
    if not ids and not allow_empty:
        ids = [tokenizer.eos_token_id]
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


def check_model(name: str | None, settings) -> None:
    """`model` omitted means the served model; naming another one is a 404, as OpenAI and vLLM answer."""
    if name is not None and name != settings.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                       f"{settings.served_model_name!r}", "model", code="model_not_found")
