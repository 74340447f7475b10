"""The load generator of `linserve bench`: streams completions from any OpenAI-compatible server and
timestamps every streamed token at the client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


class BenchError(Exception):
    """The server cannot be benchmarked (unreachable, no model, …): a clear message, exit status 2."""


@dataclass
class LoadSpec:
    url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int | None = 1  # closed loop: this many requests always in flight
    rate: float | None = None  # open loop: Poisson arrivals at this many requests/s
    requests: int | None = 16
    duration_s: float | None = None
    warmup: int = 1
    prompt_tokens: int = 32
    max_tokens: int = 64
    ignore_eos: bool = True
    temperature: float = 0.8
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestRecord:
    start: float  # seconds since the run began
    status: int = 0
    error: str | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since the request's start, per token event
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    end: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.token_times)


def synthetic_prompt(n_tokens: int, rng: random.Random) -> str:
    """About n_tokens tokens for common BPE tokenizers: short frequent words separated by spaces."""
    words = ["the", "and", "of", "to", "my", "in", "you", "that", "is", "not", "with", "me", "it", "for", "be"]
    return " ".join(rng.choice(words) for _ in range(n_tokens))


async def discover_model(client: httpx.AsyncClient, spec: LoadSpec) -> str:
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as error:
        raise BenchError(f"cannot reach {spec.url}: {error.__class__.__name__}: {error}") from None
    if response.status_code != 200:
        raise BenchError(f"{spec.url}/v1/models answered {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise BenchError(f"{spec.url} serves no model")
    return models[0]["id"]


SERVER_FIELDS = ("version", "device", "dtype", "threads", "cpu_threads", "decode_step")


def server_info(spec: LoadSpec) -> dict | None:
    """What the server says it runs with (linserve's /version: device, dtype, threads, decode step), recorded
    beside the figures; None for a server without that route (another OpenAI-compatible server)."""
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    try:
        response = httpx.get(f"{spec.url}/version", headers=headers, timeout=10)
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    return {name: body[name] for name in SERVER_FIELDS if name in body} or None


async def stream_one(client: httpx.AsyncClient, spec: LoadSpec, model: str, prompt: str, run_start: float,
                     seed: int) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter() - run_start)
    body = {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed, "ignore_eos": spec.ignore_eos}
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:300]
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = time.perf_counter() - started
                event = json.loads(data)
                if event.get("usage"):
                    record.prompt_tokens = event["usage"].get("prompt_tokens")
                    record.completion_tokens = event["usage"].get("completion_tokens")
                for _ in event.get("choices") or []:
                    record.token_times.append(now)  # servers send one event per token
        if record.completion_tokens is not None:
            del record.token_times[record.completion_tokens :]  # a finish-only event carries no token
    except httpx.HTTPError as error:
        record.error = f"{error.__class__.__name__}: {error}"
    finally:
        record.end = time.perf_counter() - run_start
    return record


async def run_load(spec: LoadSpec, progress=None) -> tuple[str, list[RequestRecord], float]:
    """Warm up, then drive the load; returns (model, records, wall seconds of the measured part)."""
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=max(spec.concurrency or 1, 64), max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=spec.url, headers=headers, timeout=spec.timeout_s, limits=limits) as client:
        model = spec.model or await discover_model(client, spec)
        rng = random.Random(spec.seed)
        prompts = [synthetic_prompt(spec.prompt_tokens, rng) for _ in range(16)]
        t0 = time.perf_counter()
        for i in range(spec.warmup):
            warm = await stream_one(client, spec, model, prompts[i % 16], t0, spec.seed + i)
            if not warm.ok:
                raise BenchError(f"warm-up request failed: status {warm.status}: {warm.error}")

        records: list[RequestRecord] = []
        run_start = time.perf_counter()
        deadline = run_start + spec.duration_s if spec.duration_s else None
        budget = spec.requests if spec.requests is not None else 10**9
        issued = 0

        def more() -> bool:
            return issued < budget and (deadline is None or time.perf_counter() < deadline)

        async def one(index: int) -> None:
            record = await stream_one(client, spec, model, prompts[index % 16], run_start, spec.seed + 1000 + index)
            records.append(record)
            if progress is not None:
                progress(record)

        if spec.rate:  # open loop: Poisson arrivals, independent of completions
            arrivals = random.Random(spec.seed + 1)
            tasks = []
            while more():
                tasks.append(asyncio.create_task(one(issued)))
                issued += 1
                await asyncio.sleep(arrivals.expovariate(spec.rate))
            await asyncio.gather(*tasks)
        else:  # closed loop: each worker sends its next request when the last one ends
            async def worker() -> None:
                nonlocal issued
                while more():
                    index = issued
                    issued += 1
                    await one(index)

            await asyncio.gather(*(worker() for _ in range(spec.concurrency or 1)))
        return model, records, time.perf_counter() - run_start
