"""SPEC P10 resume — continuing a session costs the same for a 100- and a 100,000-token history, from
every tier: device slot, host memory, the dir store (as after a restart) and Redis (as on another replica).

    python benchmarks/p10_resume.py [--reps 7] [--redis URL] [--quick] [--out FILE]

Redis: `--redis URL`, else a private `redis-server` (Debian's package) on a free port, else the tier is skipped.

In process, shipped model, the real engine: two sessions are prefilled with 100 and `--long` tokens; in
each repetition each is put in each tier (the store's writes finished first) and continued by one prompt
token and one generated token; the time from submit to the last output is recorded.
Target: median(100,000) / median(100) <= 1.10 for every tier.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT, load_model  # noqa: E402
from linserve.server.engine import Engine, EngineConfig, EngineRequest, SamplingParams  # noqa: E402
from linserve.server.settings import Settings  # noqa: E402

TIERS = ("device", "host", "dir")
STORE_TIERS = ("dir", "redis")  # continued from the store: the session is in no slot and not in host memory


def finish(engine: Engine, request: EngineRequest) -> float:
    done: queue.Queue = queue.Queue()
    started = time.perf_counter()
    engine.submit(request, done.put).result(600)
    while not done.get(timeout=600).finished:
        pass
    return time.perf_counter() - started


def put_in_tier(engine: Engine, session_id: str, tier: str) -> None:
    registry = engine.registry
    engine.store_worker.flush()  # the previous turn's record is written: no disk work overlaps a timing

    def move() -> None:
        session = registry.by_id[session_id]
        if tier in ("host", *STORE_TIERS) and session.slot is not None:
            registry.tiers.offload(session)
        if tier in STORE_TIERS:
            registry.discard(session)  # from memory only: its record stays, as after a restart

    engine.commands.call(move).result(60)


def new_session(engine: Engine, history: int, generator: torch.Generator) -> str:
    session = engine.sessions.create(None).result(60)
    ids = torch.randint(0, engine.vocab_size, (history,), generator=generator).tolist()
    finish(engine, EngineRequest(f"fill-{history}", ids, SamplingParams(max_tokens=0), session_id=session.id))
    return session.id


def resume_times(engines: dict[str, Engine], histories: tuple[int, ...], reps: int, generator: torch.Generator) -> dict:
    """times[history][tier]: seconds per continuation, histories and tiers interleaved in every repetition
    so machine noise falls on all of them alike. `engines`: tier → the engine measuring it."""
    sessions = {
        (history, id(engine)): new_session(engine, history, generator)
        for engine in set(engines.values())
        for history in histories
    }
    times = {history: {tier: [] for tier in engines} for history in histories}
    for rep in range(reps):
        for tier, engine in engines.items():
            for history in histories if rep % 2 == 0 else histories[::-1]:  # neither always goes first
                session_id = sessions[(history, id(engine))]
                put_in_tier(engine, session_id, tier)
                token = int(torch.randint(0, engine.vocab_size, (1,), generator=generator))
                request = EngineRequest(
                    f"r-{history}-{tier}-{rep}",
                    [token],
                    SamplingParams(max_tokens=1, temperature=0),
                    session_id=session_id,
                )
                times[history][tier].append(finish(engine, request))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--long", type=int, default=100_000)
    parser.add_argument("--redis", help="redis://HOST:PORT/DB to measure the Redis tier against")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.long = 2, 1_000
    from transformers import AutoTokenizer

    model = load_model(DEFAULT_CHECKPOINT, torch.device("cpu")).model
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))
    started = []
    with tempfile.TemporaryDirectory() as store, private_redis(args.redis, store) as redis_url:

        def engine_on(spec: str) -> Engine:
            started.append(
                Engine(
                    model,
                    tokenizer,
                    EngineConfig.from_settings(Settings(compile="off", num_slots=8, session_store=spec)),
                    torch.device("cpu"),
                ).start()
            )
            return started[-1]

        local = engine_on(f"dir:{store}")
        engines = {tier: local for tier in TIERS}
        if redis_url:
            engines["redis"] = engine_on(redis_url)
        try:
            times = resume_times(engines, (100, args.long), args.reps, torch.Generator().manual_seed(0))
            short, long = times[100], times[args.long]
        finally:
            for engine in started:
                engine.stop()
    result = {"P10": {}}
    for tier in engines:
        a, b = statistics.median(short[tier]), statistics.median(long[tier])
        result["P10"][tier] = {
            "ms_at_100": a * 1e3,
            f"ms_at_{args.long}": b * 1e3,
            "ratio": b / a,
            "target": "<= 1.10",
            "pass": b / a <= 1.10,
        }
    emit(result, args.out)


@contextlib.contextmanager
def private_redis(url: str | None, directory: str):
    """The given URL, or a redis-server of our own on a free port (None when there is none)."""
    binary = shutil.which("redis-server")
    if url or binary is None:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait(10)


if __name__ == "__main__":
    main()
    from linserve.server.cli import exit_now

    exit_now(0)  # as `linserve` ends: no interpreter teardown, whose native destructors (the in-process engines'
    # thread pools, loaded programs) can abort a finished run with "terminate called without an active exception"
