"""SPEC P8: state bytes per session equal the config's formula; RSS stays flat over a long generation.

    python benchmarks/memory.py [--tokens 65536] [--quick] [--no-server] [--out FILE]

Two long generations of `--tokens` tokens, RSS growth measured from the end of a warm-up (1,024 tokens)
to the end (target <= 0.5%):
- in process: the shipped model's recurrent decode loop, the state passed along;
- served: one stateless SSE stream from a real `linserve serve` (shipped model), the server's RSS sampled
  from /proc while the stream runs — so per-request bookkeeping that grew with length would show here.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, tree_rss_bytes  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.generate import decode_one_token, prefill
from linserve.model.loading import DEFAULT_CHECKPOINT, load_model
from linserve.server.engine import SamplingParams  # noqa: E402
from linserve.server.engine.state_pool import StatePool  # noqa: E402
from linserve.server.settings import Settings  # noqa: E402

WARMUP_TOKENS = 1024
RSS_TARGET = 0.005


def rss_bytes(pid: int | None = None) -> int:
    """This process's resident bytes, or a server's with every process under it (its engine core)."""
    if pid is not None:
        return tree_rss_bytes(pid)
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_stream(tokens: int) -> dict:
    """One stateless stream of `tokens` tokens from a real server; its RSS sampled every 4,096 tokens."""
    port = free_port()
    server = start_server(str(DEFAULT_CHECKPOINT), port, 4, compile="off")  # memory, not speed: no compile thread
    try:
        body = {"prompt": "ROMEO.", "max_tokens": tokens, "ignore_eos": True, "temperature": 0.8, "seed": 0,
                "stream": True}
        seen, baseline, samples, started = 0, None, [], time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=None) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                seen += 1
                if seen == WARMUP_TOKENS:
                    baseline = rss_bytes(server.pid)
                if seen % 4096 == 0:
                    samples.append({"tokens": seen, "rss_mb": rss_bytes(server.pid) / 2**20})
        end = rss_bytes(server.pid)
        assert seen >= tokens, f"the stream ended after {seen} events"
        growth = (end - baseline) / baseline
        return {"tokens": tokens, "after_warmup_mb": baseline / 2**20, "end_mb": end / 2**20, "growth": growth,
                "bytes_per_token": (end - baseline) / (tokens - WARMUP_TOKENS), "target": f"<= {RSS_TARGET}",
                "pass": growth <= RSS_TARGET, "tokens_per_s": tokens / (time.perf_counter() - started),
                "samples": samples}
    finally:
        server.terminate()
        server.wait(30)


def session_bytes(model, long_tokens: int) -> dict:
    """Bytes a session holds (state, history, turn snapshots) after 10 tokens and after `long_tokens`,
    each in two turns, through the real engine and the shipped model. (Under 6 tokens a session's tail
    is shorter, so it is a few bytes smaller: 10 is past that.)"""
    from transformers import AutoTokenizer

    from linserve.server.engine import Engine, EngineConfig, EngineRequest

    with torch.inference_mode(False):  # the pool's buffers are written outside inference mode too
        engine = Engine(
            model,
            AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT)),
            EngineConfig.from_settings(Settings(compile="off", session_store="none", num_slots=4)),
            torch.device("cpu"),
        ).start()
    generator = torch.Generator().manual_seed(0)
    try:
        measured = {}
        for total in (10, long_tokens):
            session = engine.sessions.create(None).result(60)
            for turn, length in enumerate((total - total // 5, total // 5)):  # 8 + 2 tokens: both turns past the tail
                ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()
                done = queue.Queue()
                engine.submit(
                    EngineRequest(f"{total}-{turn}", ids, SamplingParams(max_tokens=0), session_id=session.id), done.put
                ).result(60)
                while not done.get(timeout=600).finished:
                    pass

            def held(sid=session.id) -> tuple[int, int]:
                s = engine.registry.by_id[sid]
                return s.tokens, s.nbytes() + (engine.pool.slot_bytes if s.slot is not None else 0)

            measured[total] = engine.commands.call(held).result(60)
    finally:
        engine.stop()
    (short_tokens, short_bytes), (long_count, long_bytes) = measured[10], measured[long_tokens]
    return {
        "tokens": [short_tokens, long_count],
        "bytes": [short_bytes, long_bytes],
        "target": "equal",
        "pass": short_bytes == long_bytes,
    }


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-server", action="store_true", help="skip the served stream")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = 2048
    # memory, not speed: one thread — two OpenMP threads beside other busy processes (the suite's other worker)
    # spin at every barrier, and the quick run's 2,048 fp32 eager tokens took 103 s against 11 s on one
    torch.set_num_threads(1)
    model = load_model(DEFAULT_CHECKPOINT, torch.device("cpu")).model
    c = model.config
    formula = (
        c.n_layers * 4 * (c.n_heads * c.d_feature * c.d_head + c.n_heads * c.d_feature + c.conv_window * c.d_model)
    )
    logits, state = prefill(model, torch.tensor([[0]]))
    pool = StatePool(model, 4, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    samples, started = [], time.perf_counter()
    baseline = None
    for i in range(1, args.tokens + 1):
        token = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)[:, 0]
        logits, state = decode_one_token(model, token, state)
        if i == WARMUP_TOKENS:
            baseline = rss_bytes()
        if i % 4096 == 0 or i == args.tokens:
            samples.append({"tokens": i, "rss_mb": rss_bytes() / 2**20, "state_bytes": state.nbytes()})
    end = rss_bytes()
    growth = (end - baseline) / baseline
    result = {
        "P8": {
            "state_bytes": {
                "formula": formula,
                "config_state_bytes": model.state_bytes(),
                "pool_slot_bytes": pool.slot_bytes,
                "actual_after_generation": state.nbytes(),
                "equal": formula == model.state_bytes() == pool.slot_bytes == state.nbytes(),
            },
            "rss": {
                "tokens": args.tokens,
                "after_warmup_mb": baseline / 2**20,
                "end_mb": end / 2**20,
                "growth": growth,
                "target": f"<= {RSS_TARGET}",
                "pass": growth <= RSS_TARGET,
                "samples": samples,
            },
            "tokens_per_s": args.tokens / (time.perf_counter() - started),
        }
    }
    result["P8"]["session_bytes"] = session_bytes(model, 2_000 if args.quick else 100_000)
    if not args.no_server:
        result["P8"]["served_rss"] = served_stream(args.tokens)
    emit(result, args.out)


if __name__ == "__main__":
    main()
