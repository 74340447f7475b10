"""The load generator of `linserve bench`: streams completions from any OpenAI-compatible server and
timestamps every streamed token at the client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
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


async def discover_model(session: aiohttp.ClientSession, spec: LoadSpec) -> str:
    try:
        async with session.get(f"{spec.url}/v1/models") as response:
            status, text = response.status, await response.text()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
        raise BenchError(f"cannot reach {spec.url}: {error.__class__.__name__}: {error}") from None
    if status != 200:
        raise BenchError(f"{spec.url}/v1/models answered {status}: {text[:200]}")
    try:
        models = json.loads(text).get("data") or []
    except (ValueError, AttributeError):
        models = []
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


async def stream_one(session: aiohttp.ClientSession, spec: LoadSpec, model: str, prompt: str, epoch: float,
                     seed: int) -> RequestRecord:
    """One streamed completion, every token event timestamped as it arrives (SSE lines parsed from the raw bytes:
    aiohttp's stream costs a quarter of httpx's CPU per event, and a load generator must cost less than the
    server)."""
    record = RequestRecord(start=time.perf_counter() - epoch)
    body = {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed, "ignore_eos": spec.ignore_eos}
    started = time.perf_counter()
    try:
        async with session.post(f"{spec.url}/v1/completions", json=body) as response:
            record.status = response.status
            if response.status != 200:
                record.error = (await response.text(errors="replace"))[:300]
                return record
            pending, done = b"", False
            async for chunk in response.content.iter_any():
                now = time.perf_counter() - started
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if event.get("usage"):
                        record.prompt_tokens = event["usage"].get("prompt_tokens")
                        record.completion_tokens = event["usage"].get("completion_tokens")
                    for _ in event.get("choices") or []:
                        record.token_times.append(now)  # servers send one event per token
                if done:
                    break
        if record.completion_tokens is not None:
            del record.token_times[record.completion_tokens :]  # a finish-only event carries no token
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as error:
        record.error = f"{error.__class__.__name__}: {error}"
    finally:
        record.end = time.perf_counter() - epoch
    return record


class Issuer:
    """Hands out the indices of the requests to send, in the order they are sent, up to the spec's requests and
    duration from `epoch`: one per run, or shared by a run's processes (`counter`, a multiprocessing Value)."""

    def __init__(self, spec: LoadSpec, epoch: float, counter=None) -> None:
        self.budget = spec.requests if spec.requests is not None else 10**9
        self.deadline = epoch + spec.duration_s if spec.duration_s else None
        self.counter, self.issued = counter, 0

    def next(self) -> int | None:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        if self.counter is None:
            index, self.issued = self.issued, self.issued + 1
        else:
            with self.counter.get_lock():
                index = self.counter.value
                self.counter.value = index + (index < self.budget)
        return index if index < self.budget else None


def open_session(spec: LoadSpec) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=spec.timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0))  # (as many connections as streams)


def prompts_of(spec: LoadSpec) -> list[str]:
    rng = random.Random(spec.seed)
    return [synthetic_prompt(spec.prompt_tokens, rng) for _ in range(16)]


async def warm_up(session: aiohttp.ClientSession, spec: LoadSpec) -> str:
    """The model to ask for, and the warm-up requests sent (not measured)."""
    model = spec.model or await discover_model(session, spec)
    prompts, t0 = prompts_of(spec), time.perf_counter()
    for i in range(spec.warmup):
        warm = await stream_one(session, spec, model, prompts[i % 16], t0, spec.seed + i)
        if not warm.ok:
            raise BenchError(f"warm-up request failed: status {warm.status}: {warm.error}")
    return model


async def drive_load(session: aiohttp.ClientSession, spec: LoadSpec, model: str, issuer: Issuer, epoch: float,
                     progress=None, arrivals_seed: int | None = None) -> list[RequestRecord]:
    """The measured load from `epoch` on: closed loop (spec.concurrency streams, each sending its next request
    when the last ends) or open loop (Poisson arrivals at spec.rate, independent of completions)."""
    prompts, records = prompts_of(spec), []

    async def one(index: int) -> None:
        record = await stream_one(session, spec, model, prompts[index % 16], epoch, spec.seed + 1000 + index)
        records.append(record)
        if progress is not None:
            progress(record)

    if spec.rate:
        arrivals, tasks = random.Random(spec.seed + 1 if arrivals_seed is None else arrivals_seed), []
        while (index := issuer.next()) is not None:
            tasks.append(asyncio.create_task(one(index)))
            await asyncio.sleep(arrivals.expovariate(spec.rate))
        await asyncio.gather(*tasks)
    else:
        async def stream() -> None:
            while (index := issuer.next()) is not None:
                await one(index)

        await asyncio.gather(*(stream() for _ in range(spec.concurrency or 1)))
    return records


async def run_load(spec: LoadSpec, progress=None) -> tuple[str, list[RequestRecord], float]:
    """Warm up, then drive the load in this process; returns (model, records, wall seconds of the measured
    part). `processes.drive` spreads a load over several processes."""
    async with open_session(spec) as session:
        model = await warm_up(session, spec)
        epoch = time.perf_counter()
        records = await drive_load(session, spec, model, Issuer(spec, epoch), epoch, progress)
        return model, records, time.perf_counter() - epoch
