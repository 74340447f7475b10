"""The load generator of `linserve bench`: streams completions from any OpenAI-compatible server and
timestamps every streamed token at the client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from .http_client import Client


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


async def discover_model(client: Client, spec: LoadSpec) -> str:
    try:
        status, body = await client.request("GET", "/v1/models")
    except (OSError, TimeoutError) as error:
        raise BenchError(f"cannot reach {spec.url}: {error.__class__.__name__}: {error}") from None
    text = body.decode(errors="replace")
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


class TokenEvents:
    """A streamed completion's lines as they arrive: each token event's arrival into the record (seconds since the
    request started), the usage noted; nothing after `data: [DONE]`."""

    def __init__(self, record: RequestRecord, started: float) -> None:
        self.record, self.started, self.done = record, started, False

    def __call__(self, line: bytes, arrived: float) -> None:
        if self.done or not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if usage := event.get("usage"):
            self.record.prompt_tokens = usage.get("prompt_tokens")
            self.record.completion_tokens = usage.get("completion_tokens")
        for _ in event.get("choices") or []:
            self.record.token_times.append(arrived - self.started)  # servers send one event per token


async def stream_one(client: Client, spec: LoadSpec, model: str, prompt: str, epoch: float,
                     seed: int) -> RequestRecord:
    """One streamed completion, every token event timestamped as its bytes arrive (http_client.py)."""
    record = RequestRecord(start=time.perf_counter() - epoch)
    body = {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed, "ignore_eos": spec.ignore_eos}
    started = time.perf_counter()
    try:
        record.status, kept = await client.request("POST", "/v1/completions", json.dumps(body).encode(),
                                                   TokenEvents(record, started))
        if record.status != 200:
            record.error = kept.decode(errors="replace")[:300]
        elif record.completion_tokens is not None:
            del record.token_times[record.completion_tokens :]  # a finish-only event carries no token
    except (OSError, TimeoutError, ValueError) as error:
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


def open_client(spec: LoadSpec) -> Client:
    """Connections to the server, as many as streams in flight."""
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    return Client(spec.url, headers, spec.timeout_s)


def prompts_of(spec: LoadSpec) -> list[str]:
    rng = random.Random(spec.seed)
    return [synthetic_prompt(spec.prompt_tokens, rng) for _ in range(16)]


async def warm_up(client: Client, spec: LoadSpec) -> str:
    """The model to ask for, and the warm-up requests sent (not measured)."""
    model = spec.model or await discover_model(client, spec)
    prompts, t0 = prompts_of(spec), time.perf_counter()
    for i in range(spec.warmup):
        warm = await stream_one(client, spec, model, prompts[i % 16], t0, spec.seed + i)
        if not warm.ok:
            raise BenchError(f"warm-up request failed: status {warm.status}: {warm.error}")
    return model


async def drive_load(client: Client, spec: LoadSpec, model: str, issuer: Issuer, epoch: float,
                     progress=None, arrivals_seed: int | None = None) -> list[RequestRecord]:
    """The measured load from `epoch` on: closed loop (spec.concurrency streams, each sending its next request
    when the last ends) or open loop (Poisson arrivals at spec.rate, independent of completions)."""
    prompts, records = prompts_of(spec), []

    async def one(index: int) -> None:
        record = await stream_one(client, spec, model, prompts[index % 16], epoch, spec.seed + 1000 + index)
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
    async with open_client(spec) as client:
        model = await warm_up(client, spec)
        epoch = time.perf_counter()
        records = await drive_load(client, spec, model, Issuer(spec, epoch), epoch, progress)
        return model, records, time.perf_counter() - epoch
