"""Same request, same tokens — and what it costs. Servers of the shipped model, side by side in one run:

- `exact`: the default configuration (dtype auto → bf16 on a CPU with bf16 lanes: AVX512; compiled programs that
  compute what the eager model does, bit for bit: `compile_autotune` off; projections through linserve's kernel);
- `exact_onednn`: the same with the kernel off (`LINSERVE_KERNELS=off`: oneDNN's inner product, wave 6's default);
- `autotuned`: `compile_autotune: true` with the kernel off (Inductor's max-autotune GEMM templates: fast, but a
  row's result depends on its bucket) — the default before 2026-11-26, except that prefill then ran in fp32;
- `fp32`: `--dtype float32` with `compile_autotune: true` (what the issue proposed as the fallback);
- `fp32_plain`: `--dtype float32` with the default programs (`dtype auto` on a CPU without AVX2, on an AVX2 CPU
  without AVX512 before 2026-12-03, and on an AVX512 CPU without AVX512-BF16 before 2026-12-01);
- `exact_int8`: the default configuration with `--quantization int8` (weight-only int8 through the same kernel:
  the same guarantee, half the projection bytes).

For each, two things:
1. invariance, over 8 greedy prompts of `--prompt-tokens` tokens from the validation plays (`--generate` tokens
   each) and the same 8 seeded (temperature 0.8, seed 7): each request alone vs the 8 sent at once; the 8 at
   once twice; alone with `speculative: ngram` vs alone without. Counted: outputs identical of 8;
   (outputs compared as text);
2. served tokens/s (`linserve bench`'s client, temperature 0.8, ignore_eos) at 1 stream and 8 streams, the
   servers taking turns within each repetition so drift falls on all of them; the ratio to `autotuned`
   (today's bf16 speed) is the figure the issue asks for.

    python benchmarks/batch_invariance.py [--reps 3] [--prompt-tokens 128] [--generate 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import emit, machine_check, reference_workload_ms  # noqa: E402
from serving_overhead import start_server  # noqa: E402
from threads import interleaved_rates  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.model.training.corpus import load_corpus  # noqa: E402

SERVERS = {
    "exact": ([], {}),
    "exact_onednn": ([], {"LINSERVE_KERNELS": "off"}),
    "autotuned": ([], {"LINSERVE_COMPILE_AUTOTUNE": "true", "LINSERVE_KERNELS": "off"}),
    "fp32": (["--dtype", "float32"], {"LINSERVE_COMPILE_AUTOTUNE": "true"}),
    "fp32_plain": (["--dtype", "float32"], {}),
    "exact_int8": (["--quantization", "int8"], {}),
}


def prompts(corpus_dir: str, count: int, length: int) -> list[list[int]]:
    """`count` openings of `length` tokens from the validation plays (never trained on), as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))
    text = "\n".join(load_corpus(corpus_dir).validation.values())
    ids = tokenizer.encode(text)
    step = (len(ids) - length) // count
    return [ids[i * step : i * step + length] for i in range(count)]


def complete(port: int, ids: list[int], params: dict) -> str:
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": ids, **params}, timeout=600)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def invariance(port: int, batch: list[list[int]], generate: int) -> dict:
    counts = {}
    for name, params in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 7})):
        params = {**params, "max_tokens": generate, "ignore_eos": True}
        alone = [complete(port, ids, params) for ids in batch]
        send = functools.partial(complete, port, params=params)
        with ThreadPoolExecutor(len(batch)) as pool:
            first, second = list(pool.map(send, batch)), list(pool.map(send, batch))
        speculating = [complete(port, ids, {**params, "speculative": {"method": "ngram"}}) for ids in batch]
        counts[name] = {"alone_vs_together": sum(a == b for a, b in zip(alone, first)),
                        "together_twice": sum(a == b for a, b in zip(first, second)),
                        "speculative_vs_plain": sum(a == b for a, b in zip(alone, speculating)),
                        "of": len(batch)}
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--generate", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream at 1 stream (half at 8)")
    parser.add_argument("--slots", type=int, default=8, help="--num-slots (buckets 1 … slots are compiled)")
    parser.add_argument("--port", type=int, default=8831)
    parser.add_argument("--corpus-dir", default="data/corpus")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    before = reference_workload_ms()
    servers = {}
    try:
        for index, name in enumerate(args.servers):
            flags, env = SERVERS[name]
            servers[name] = (args.port + index, start_server(
                args.model, args.port + index, args.slots, env={"LINSERVE_SESSION_STORE": "none", **env},
                extra=["--log-level", "warning", *flags]))
        versions = {name: httpx.get(f"http://127.0.0.1:{port}/version", timeout=10).json()
                    for name, (port, _) in servers.items()}
        batch = prompts(args.corpus_dir, 8, args.prompt_tokens)
        identical = {name: invariance(port, batch, args.generate) for name, (port, _) in servers.items()}
        loads = {"1_stream": (1, args.tokens), "8_streams": (8, max(args.tokens // 2, 1))}
        rates = interleaved_rates({name: port for name, (port, _) in servers.items()}, loads, args.reps)
    finally:
        for _, process in servers.values():
            process.terminate()
        for _, process in servers.values():
            process.wait(30)
    table = {}
    for name in servers:
        step = versions[name].get("decode_step") or {}
        row = {"dtype": versions[name].get("dtype"), "decode_step": step.get("status"), "identical": identical[name]}
        for load in loads:
            samples = rates[(name, load)]
            row[load] = {"tokens_per_s": statistics.median(samples), "spread": [min(samples), max(samples)]}
        table[name] = row
    if "autotuned" in table:
        for row in table.values():
            for load in loads:
                row[load]["vs_autotuned"] = row[load]["tokens_per_s"] / table["autotuned"][load]["tokens_per_s"]
    emit({"reps": args.reps, "prompt_tokens": args.prompt_tokens, "generate": args.generate,
          "machine": machine_check(before, reference_workload_ms()), "servers": table}, args.out)


if __name__ == "__main__":
    main()
