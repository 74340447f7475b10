"""A completions request served: its prompts encoded, the generation started, its results as one JSON answer
or server-sent events (chunks.py), a retried session turn replayed, and the completions logprobs format.
Sessions continue through it too."""

from __future__ import annotations

from fastapi import BackgroundTasks, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from ...engine.types import AlreadyApplied, Idempotency, RequestOutput
from .choice_logprobs import ChoiceLogprobs, token_text
from .chunks import CompletionChunks, chunk_json
from .completion_protocol import CompletionChoice, CompletionRequest, CompletionResponse
from .dependencies import check_model, encode_prompt, get_limits
from .errors import APIError
from .generation import Generation, collect, reserve_logprobs, start_generation, stream_events
from .limits import RequestLimits
from .protocol import CompletionLogprobs, Usage
from .streaming import EventStreamResponse, sse_event
from .structured import with_grammar


def completion_chunk(generation: Generation, model: str, output, echo_text: str = "",
                     logprobs: CompletionLogprobs | None = None) -> str:
    """One streamed event: the output's text (after `echo_text`, a row's echoed prompt) and the logprobs its
    text releases (see ChoiceLogprobs)."""
    choice = CompletionChoice(index=output.index, text=echo_text + output.text, logprobs=logprobs,
                              finish_reason=output.finish_reason.value if output.finished else None)
    return chunk_json(CompletionResponse(id=generation.request_id, created=generation.created, model=model,
                                         choices=[choice]))


async def encode_prompts(request: Request, body: CompletionRequest, limits: RequestLimits,
                         session_id: str | None) -> list[list[int]]:
    """Token ids of each prompt of the request (a session continues with exactly one)."""
    limits.check_batch(len(body.prompts), session=session_id is not None)
    return [await encode_prompt(request, prompt, allow_empty=session_id is not None, starts=session_id is None)
            for prompt in body.prompts]


async def run_completion(request: Request, body: CompletionRequest, settings, tokenizer, owner,
                         background: BackgroundTasks, session_id: str | None = None,
                         idempotency: Idempotency | None = None, expected_revision: str | None = None):
    check_model(body.model, settings)
    limits = get_limits(request)
    params = body.to_sampling_params(limits)
    prompts = await encode_prompts(request, body, limits, session_id)
    params = await with_grammar(request, body, params)
    reservation = reserve_logprobs(request, prompts, params, body.stream, background)
    try:
        try:
            generation = await start_generation(request, prompts, params, "cmpl", session_id, owner, idempotency,
                                                expected_revision)
        except AlreadyApplied as applied:
            reservation.release()
            return replay_completion(applied, body, settings.served_model_name, tokenizer)
        return await _completion(request, body, settings, tokenizer, generation, prompts, params,
                                 reservation.release)
    except BaseException:
        reservation.release()
        raise


def replay_completion(applied: AlreadyApplied, body: CompletionRequest, model: str, tokenizer):
    """A retried session turn that is already part of the session: the first attempt's answer, streamed or not
    as this request asks (its text, finish reason and usage; logprobs are not kept)."""
    result = applied.result
    if result is None:
        raise APIError(409, f"{applied.message}; its result was too long to keep, so it cannot be returned again",
                       "Idempotency-Key", code="already_applied")
    prompt = body.prompts[0]
    echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if body.echo else ""
    usage = Usage(prompt_tokens=result["prompt_tokens"], completion_tokens=result["completion_tokens"],
                  total_tokens=result["prompt_tokens"] + result["completion_tokens"])
    choice = CompletionChoice(index=0, text=echo + result["text"], finish_reason=result["finish_reason"])
    response = CompletionResponse(id=result["id"], created=result["created"], model=model, choices=[choice],
                                  usage=usage)
    headers = {"Idempotent-Replayed": "true"}
    if not body.stream:
        return JSONResponse(jsonable_encoder(response), headers=headers)
    events = [chunk_json(response.model_copy(update={"usage": None}))]
    if body.include_usage:
        events.append(chunk_json(response.model_copy(update={"choices": []})))

    async def replayed():
        for event in events:
            yield sse_event(event)
        yield sse_event("[DONE]")

    return EventStreamResponse(replayed(), headers=headers)


async def _completion(request: Request, body: CompletionRequest, settings, tokenizer, generation: Generation,
                      prompts: list[list[int]], params, on_close):
    model = settings.served_model_name
    # echo: each choice starts with its prompt's text (a token-id prompt decoded)
    echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompts] if body.echo else None

    def echo(index: int) -> str:
        return echoes[index // params.n] if echoes else ""

    if body.stream:

        def usage_chunk() -> dict:
            return {
                "id": generation.request_id,
                "object": "text_completion",
                "created": generation.created,
                "model": model,
                "choices": [],
                "usage": generation.usage,
            }

        scoring = params.prompt_logprobs is not None  # the echo goes out with its logprobs, after the prefill
        first = [
            completion_chunk(generation, model, _empty(i), echo(i))
            for i in range(generation.rows)
            if echo(i) and not scoring
        ]
        if params.logprobs is None:  # the hot path: a prepared template, no model per token
            chunk = CompletionChunks(generation.request_id, generation.created, model)
        else:
            choices: dict[int, ChoiceLogprobs] = {}  # each choice's logprobs, released with its text

            def chunk(output) -> str:
                echoed, logprobs = "", CompletionLogprobs()
                if output.index not in choices:  # a row's first event: echo, and with scoring its prompt's logprobs
                    choices[output.index] = ChoiceLogprobs(tokenizer, len(echo(output.index)))
                    if output.prompt_logprobs is not None:
                        echoed = echo(output.index)
                        add_completion_entries(tokenizer, logprobs, choices[output.index].prompt(
                            prompts[output.index // params.n], output.prompt_logprobs))
                add_completion_entries(tokenizer, logprobs, choices[output.index].push(output))
                return completion_chunk(generation, model, output, echoed, logprobs)

        return stream_events(generation, chunk, body.include_usage, usage_chunk, first, on_close)
    rows = await collect(request, generation)
    if rows is None:
        return None
    choices = []
    for index, outputs in enumerate(rows):
        logprobs = (completion_logprobs(tokenizer, outputs, len(echo(index)), prompts[index // params.n])
                    if params.logprobs is not None else None)
        choices.append(
            CompletionChoice(
                index=index,
                text=echo(index) + "".join(o.text for o in outputs),
                logprobs=logprobs,
                finish_reason=outputs[-1].finish_reason.value,
            )
        )
    return CompletionResponse(
        id=generation.request_id,
        created=generation.created,
        model=model,
        choices=choices,
        usage=Usage(**generation.usage),
    )


def _empty(index: int) -> RequestOutput:
    """A token-less output: carries the echoed prompt as the first event of each row."""
    return RequestOutput(request_id="", index=index, token_id=None, text="")


# ---------------------------------------------------------------- the completions logprobs format
def add_completion_entries(tokenizer, result: CompletionLogprobs, entries: list[tuple]) -> CompletionLogprobs:
    """Entries in the completions format (parallel lists; a token nothing predicts has a null logprob)."""
    for token_id, lp, at in entries:
        result.tokens.append(token_text(tokenizer, token_id))
        result.token_logprobs.append(None if lp is None else lp.logprob)
        result.top_logprobs.append(None if lp is None else {token_text(tokenizer, t): v for t, v in lp.top})
        result.text_offset.append(at)
    return result


def completion_logprobs(tokenizer, outputs: list[RequestOutput], offset: int = 0,
                        prompt_ids: list[int] | None = None) -> CompletionLogprobs:
    """A whole choice's logprobs (generated tokens' offsets from `offset`, the echo's length); with `prompt_ids`
    and scored prompt tokens on the first output (echo), the prompt's tokens first, offsets from 0."""
    result, choice = CompletionLogprobs(), ChoiceLogprobs(tokenizer, offset)
    if outputs and prompt_ids is not None and outputs[0].prompt_logprobs is not None:
        add_completion_entries(tokenizer, result, choice.prompt(prompt_ids, outputs[0].prompt_logprobs))
    for output in outputs:
        add_completion_entries(tokenizer, result, choice.push(output))
    return result
