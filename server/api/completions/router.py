"""POST /v1/completions (OpenAI's legacy completions API): the route; the work is common/completion_serving.py's
(shared with a session's completions)."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Request

from ..common.completion_protocol import CompletionRequest, CompletionResponse
from ..common.completion_serving import run_completion
from ..common.dependencies import Owner, SettingsDep, TokenizerDep
from ..common.openapi import GENERATION, errors, streamed

router = APIRouter()


@router.post("/v1/completions", response_model=None, responses={**streamed(CompletionResponse), **errors(*GENERATION)})
async def completions(request: Request, body: CompletionRequest, settings: SettingsDep, tokenizer: TokenizerDep,
                      owner: Owner, background: BackgroundTasks):
    return await run_completion(request, body, settings, tokenizer, owner, background)
