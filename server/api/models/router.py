"""The served model and the utilities around it: /v1/models (OpenAI's), and /tokenize, /detokenize,
/tokenizer_info, /version as vLLM and llama.cpp's server offer them."""

from __future__ import annotations

import asyncio
import importlib.metadata

from fastapi import APIRouter, Request

from ..common.chat import chat_prompt
from ..common.dependencies import Owner, SettingsDep, TokenizerDep, check_model, encode_prompt, get_engine
from ..common.errors import APIError
from ..common.openapi import AUTH, BODY, errors
from .protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    VersionInfo,
)

router = APIRouter()
INLINE_DETOKENIZE = 4096  # ids decoded on the event loop; more go to a worker thread


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(*BODY))
async def tokenize(request: Request, body: TokenizeRequest, tokenizer: TokenizerDep, owner: Owner) -> TokenizeResponse:
    """A prompt's token ids (as `/v1/completions` would see them), or a chat's after its template."""
    text = await chat_prompt(request, body.messages, tokenizer) if body.messages is not None else body.prompt
    ids = await encode_prompt(request, text, allow_empty=True, starts=body.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_prompt_tokens=request.app.state.settings.max_prompt_tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(*BODY))
async def detokenize(body: DetokenizeRequest, tokenizer: TokenizerDep, owner: Owner) -> DetokenizeResponse:
    """Long lists are checked and decoded on a worker thread: the event loop (and /health) never waits."""
    vocab = len(tokenizer)

    def decode() -> str:
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return tokenizer.decode(body.tokens)

    text = decode() if len(body.tokens) <= INLINE_DETOKENIZE else await asyncio.to_thread(decode)
    return DetokenizeResponse(prompt=text)


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=errors(*AUTH))
async def tokenizer_info(request: Request, tokenizer: TokenizerDep, owner: Owner) -> TokenizerInfo:
    """Special tokens and the chat template: with /tokenize and /detokenize, what a client needs to tokenize
    as the server does without a copy of the checkpoint."""
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__, eos_token=tokenizer.eos_token, bos_token=tokenizer.bos_token,
        pad_token=tokenizer.pad_token, vocab_size=len(tokenizer),
        checkpoint_vocab_size=get_engine(request).facts.checkpoint_vocab_size,
        model_max_length=request.app.state.settings.max_prompt_tokens,
        chat_template=getattr(tokenizer, "chat_template", None) or None,
    )


@router.get("/version", response_model=VersionInfo)
async def version(request: Request) -> VersionInfo:
    """linserve's version, the versions of what it runs on, the device, and how the decode step runs there
    (compiled or not, and compile=auto's verdict with its figures)."""
    engine = getattr(request.app.state, "engine", None)
    facts = engine.facts if engine is not None else None
    if facts is None:  # (before an engine has loaded: this process's figures — the only time the HTTP side asks torch)
        import torch

        from linserve.model import projection

        threads, projections = torch.get_num_threads(), projection.describe()
    else:
        threads, projections = facts.threads, facts.projections
    return VersionInfo(version=request.app.version, torch=importlib.metadata.version("torch"),
                       transformers=importlib.metadata.version("transformers"),
                       device=facts.device if facts else None, threads=threads,
                       cpu_threads=facts.cpu_threads if facts else None,
                       dtype=facts.weights_dtype if facts else None, projections=projections,
                       decode_step=await asyncio.to_thread(engine.describe_decode_step) if facts else None,
                       api_servers=request.app.state.settings.engine_placement())


@router.get("/v1/models", response_model=ModelList, responses=errors(*AUTH))
async def list_models(request: Request, settings: SettingsDep, owner: Owner) -> ModelList:
    return ModelList(data=[model_card(request, settings)])


def model_card(request: Request, settings) -> ModelCard:
    """The served model: its id, the checkpoint directory, its family and one session's state bytes."""
    facts = get_engine(request).facts
    return ModelCard(id=settings.served_model_name, created=request.app.state.started,
                     root=facts.checkpoint, model_type=facts.model_type,
                     state_bytes=facts.state_bytes, vocab_size=facts.vocab_size,
                     checkpoint_vocab_size=facts.checkpoint_vocab_size,
                     generation_defaults=request.app.state.generation.describe())


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(*AUTH, 404))
async def retrieve_model(request: Request, model_id: str, settings: SettingsDep, owner: Owner) -> ModelCard:
    """The served model (`client.models.retrieve(id)`); any other id is a 404, as OpenAI answers."""
    check_model(model_id, settings)
    return model_card(request, settings)
