"""Arrivals while a stream decodes, in process: the engine as `serve` builds it (compiled programs, the server's
settings), one request decoding, then N more arriving ~1 ms apart — as P9's 8 × 256 load reaches the core, whose
first request starts before the others are read. Their prompts are prefilled `max_prefill_while_decoding` tokens a
step beside the decode (mixed steps); what those steps cost is a served load's ramp:

    python benchmarks/arrivals.py [--model DIR] [--arrivals 7] [--prompt-tokens 32] [--max-tokens 256]
                                  [--rounds 3] [--out FILE]

Per round (after one warm-up round): tokens/s over the whole load, and the count and median of each phase's steps
(decode / mixed / prefill) with the time inside the decode program. Run it from two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, emit, wait_programs  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT, load_model, resolve_dtype  # noqa: E402
from linserve.server.engine import Engine, EngineConfig, EngineRequest, SamplingParams  # noqa: E402
from linserve.server.settings import Settings  # noqa: E402


def one_round(engine: Engine, steps: list, tag: str, arrivals: int, prompt_tokens: int,
              params: SamplingParams) -> dict:
    """The load once: seconds, tokens, and each phase's steps (count, median ms, median program ms)."""
    left, lock, done, first = [arrivals + 1], threading.Lock(), threading.Event(), threading.Event()

    def sink(output) -> None:
        if output.token_id is not None:
            first.set()
        if output.finished:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    def prompt(i: int) -> list[int]:
        return [(7 * j + 13 * i) % 4000 + 1 for j in range(prompt_tokens)]

    steps.clear()
    started = time.perf_counter()
    engine.submit(EngineRequest(f"{tag}-0", prompt(0), params), sink).result(30)
    first.wait(30)  # the first request decodes
    for i in range(1, arrivals + 1):
        time.sleep(0.001)
        engine.submit(EngineRequest(f"{tag}-{i}", prompt(i), params), sink).result(30)
    done.wait(600)
    seconds = time.perf_counter() - started
    phases: dict[str, list] = {}
    for phase, duration, program in list(steps):
        phases.setdefault(phase, []).append((duration, program))
    return {"tokens_per_s": (arrivals + 1) * params.max_tokens / seconds, "seconds": seconds,
            "phases": {phase: {"steps": len(rows), "median_ms": 1e3 * statistics.median(d for d, _ in rows),
                               "program_median_ms": 1e3 * statistics.median(p for _, p in rows)}
                       for phase, rows in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--arrivals", type=int, default=7)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    device = torch.device("cpu")
    dtype = resolve_dtype("auto", device)
    model = load_model(args.model, device, dtype).model
    steps: list = []

    def stats(s) -> None:
        if hasattr(s, "phase"):  # (a step's stats; the pool's come too)
            steps.append((s.phase, s.duration_s, s.program_s))

    settings = Settings(session_store="none")
    engine = Engine(model, AutoTokenizer.from_pretrained(args.model), EngineConfig.from_settings(settings), device,
                    stats, dtype=dtype).start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True, top_k=50)
    rounds = []
    try:
        wait_programs(engine)
        for r in range(args.rounds + 1):  # the first warms up
            result = one_round(engine, steps, f"r{r}", args.arrivals, args.prompt_tokens, params)
            if r:
                rounds.append(result)
                shown = ", ".join(f"{phase} {p['steps']} × {p['median_ms']:.2f} ms"
                                  for phase, p in sorted(result["phases"].items()))
                print(f"round {r}: {result['tokens_per_s']:.0f} tokens/s ({shown})", flush=True)
    finally:
        engine.stop()
    emit({**describe(device), "model": args.model, "dtype": str(dtype), "arrivals": args.arrivals,
          "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": rounds,
          "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds)}, args.out)


if __name__ == "__main__":
    main()
