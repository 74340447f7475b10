"""SPEC P2: flat per-token latency when served — 8 streams × 8,192 tokens over HTTP/SSE.

Starts `linserve serve` with the shipped checkpoint and, beside it, the softmax baseline (same dims,
random weights: timing does not depend on them) with its KV cache; drives both with `linserve bench`'s
client; compares ITL p50 of tokens 7k–8k with tokens 0–1k; writes JSON and a PNG with both servers.

    python benchmarks/served_flatness.py [--streams 8] [--tokens 8192] [--no-softmax] [--quick] [--out-dir D]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_compile_argument, add_device_argument, describe, emit, resolve_device  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model import LinearGPT  # noqa: E402
from linserve.model.loading import DEFAULT_CHECKPOINT, load_model  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402
from linserve.server.bench.report import plot, summarize  # noqa: E402


def softmax_twin(directory: Path) -> None:
    """A random-weight softmax model with the shipped model's dims and tokenizer, saved as a checkpoint."""
    from tokenizers import Tokenizer

    from linserve.model.training.trainer import save_checkpoint

    config = load_model(DEFAULT_CHECKPOINT, torch.device("cpu")).model.config
    twin = LinearGPT(type(config)(**{**config.to_dict(), "attention": "softmax", "decay": False, "conv_kernel": 0}))
    save_checkpoint(twin, Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json")), directory, torch.float32)


def p50_between(records, low: int, high: int) -> float:
    gaps = [
        r.token_times[i] - r.token_times[i - 1]
        for r in records
        for i in range(max(low, 1), min(high, len(r.token_times)))
    ]
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


def measure(port: int, streams: int, tokens: int) -> tuple[dict, list]:
    spec = LoadSpec(
        url=f"http://127.0.0.1:{port}",
        concurrency=streams,
        requests=streams,
        warmup=1,
        prompt_tokens=16,
        max_tokens=tokens,
        ignore_eos=True,
        temperature=0.8,
    )
    run = drive(spec)
    records = run.records
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    return summarize(spec, run, max(tokens // 16, 1)), records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--no-softmax", action="store_true")
    parser.add_argument(
        "--softmax-tokens",
        type=int,
        default=2048,
        help="tokens per stream for the softmax baseline (its steps grow with context)",
    )
    parser.add_argument("--quick", action="store_true", help="short streams, eager (no compile)")
    add_compile_argument(parser)
    parser.add_argument(
        "--out-dir",
        default=None,
        help="default: benchmarks/results (the published figures); --quick: data/quick (never those)",
    )
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.quick:
        args.streams, args.tokens = 2, 256
    out_dir = Path(args.out_dir or ("data/quick" if args.quick else "benchmarks/results"))
    out_dir.mkdir(parents=True, exist_ok=True)

    servers = {"linear": (str(DEFAULT_CHECKPOINT), 8811, args.tokens)}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_softmax:
            softmax_twin(Path(tmp))
            servers["softmax"] = (tmp, 8812, min(args.softmax_tokens, args.tokens))
        results, report = {}, {}
        for name, (model_dir, port, tokens) in servers.items():
            process = start_server(
                model_dir,
                port,
                args.streams,
                extra=["--log-level", "warning"],
                env={"LINSERVE_MAX_CONTEXT": str(tokens + 64)},
                device=device.type,
                compile="off" if args.quick else args.compile,
            )
            try:
                summary, records = measure(port, args.streams, tokens)
            finally:
                process.terminate()
                process.wait(30)
            results[name] = summary
            low, high = tokens // 8, tokens - tokens // 8
            early, late = p50_between(records, 0, low), p50_between(records, high, tokens)
            per_stream = [p50_between([r], high, tokens) / p50_between([r], 0, low) for r in records]
            report[name] = {
                "tokens": tokens,
                "itl_p50_first_ms": early,
                "itl_p50_last_ms": late,
                "ratio": late / early,
                "ratio_spread_over_streams": [min(per_stream), max(per_stream)],
                "windows": [[0, low], [high, tokens]],
                "token_throughput_per_s": summary["token_throughput_per_s"],
            }
    report["machine"] = describe(device)
    report["P2"] = {
        "ratio": report["linear"]["ratio"],
        "target": "<= 1.10",
        "pass": report["linear"]["ratio"] <= 1.10,
        "streams": args.streams,
        "tokens": args.tokens,
    }
    (out_dir / "p2_served_flatness.json").write_text(json.dumps({"summary": report, "bench": results}, indent=2) + "\n")
    plot(results, out_dir / "p2_served_flatness.png")
    emit(report, None)


if __name__ == "__main__":
    main()
