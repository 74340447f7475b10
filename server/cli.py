"""`linserve` command line: serve, generate, train, eval, bench, info."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from pydantic import ValidationError
from tokenizers import Tokenizer

from model.generate import generate_tokens
from model.loading import DEFAULT_CHECKPOINT, DEVICE_CHOICES, DTYPE_CHOICES, load_model, resolve_device

SOFTMAX_EVAL_WINDOW = 1024  # a KV cache over a whole play would be quadratic; softmax is scored in windows


def _load_for_generation(args: argparse.Namespace, device: torch.device):
    from transformers import AutoTokenizer

    path = Path(args.model) if args.model else DEFAULT_CHECKPOINT
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        raise SystemExit(f"error: {path} is not a checkpoint directory with config.json and tokenizer.json")
    return load_model(path, device).model, AutoTokenizer.from_pretrained(path)


def cmd_generate(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model, tokenizer = _load_for_generation(args, device)
    prompt_ids = tokenizer.encode(args.prompt)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    generated: list[int] = []
    printed = args.prompt
    started = time.perf_counter()
    for token in generate_tokens(
        model, prompt_ids, args.max_tokens, args.temperature, args.top_k, tokenizer.eos_token_id, args.seed
    ):
        generated.append(token)
        text = tokenizer.decode(prompt_ids + generated)
        if not text.endswith("\ufffd"):  # hold back an incomplete multi-byte character
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    print(f"[{len(generated)} tokens in {elapsed:.2f}s, {len(generated) / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model, _ = _load_for_generation(args, device)
    config = model.config
    print(f"attention={config.attention} feature_map={config.feature_map} decay={config.decay} conv_kernel={config.conv_kernel}")
    print(f"layers={config.n_layers} d_model={config.d_model} heads={config.n_heads} vocab={config.vocab_size}")
    print(f"parameters={model.num_parameters()}")
    print(f"state_bytes_per_session={model.state_bytes()}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from model.training.trainer import TrainConfig, Trainer

    cfg = TrainConfig.from_yaml(args.config)
    if args.out_dir:
        cfg.out_dir = args.out_dir
    if args.max_steps is not None:
        cfg.optim.max_steps = args.max_steps
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = Trainer(cfg, resolve_device(args.device)).run()
    summary.pop("history")
    print(json.dumps(summary, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from model.training.corpus import load_corpus
    from model.training.evaluate import bits_per_byte

    device = resolve_device(args.device)
    path = Path(args.model) if args.model else DEFAULT_CHECKPOINT
    lm = load_model(path, device, getattr(torch, args.dtype))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    window = args.window
    if window is None and lm.model.config.attention == "softmax":
        window = SOFTMAX_EVAL_WINDOW
        print(f"note: softmax model: scoring independent windows of {window} tokens", file=sys.stderr)
    works = load_corpus(args.corpus_dir).validation
    result = bits_per_byte(lm.model, tokenizer, works, window=window)
    report = {"model": str(path), "dtype": args.dtype, "window": window, "works": list(works), "bits_per_byte": result.bits_per_byte,
              "nats_per_token": result.nats_per_token, "tokens": result.tokens, "bytes": result.bytes,
              "tokens_per_second": result.tokens_per_second}
    print(json.dumps(report, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from server.serve import serve
    from server.settings import Settings

    settings = Settings.load(args.config, model=args.model, host=args.host, port=args.port, device=args.device,
                             api_keys=args.api_key, num_slots=args.num_slots, log_level=args.log_level,
                             compile=args.compile, dtype=args.dtype)
    return serve(settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linserve", description="Serve causal linear-attention language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="checkpoint directory (default: the shipped checkpoint)")
        p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
        p.add_argument("--seed", type=int, default=0)

    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    gen.add_argument("prompt")
    model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible + sessions)")
    srv.add_argument("--model", help="checkpoint directory (default: the shipped checkpoint)")
    srv.add_argument("--config", help="YAML settings file (default: configs/server.yaml if present)")
    srv.add_argument("--host")
    srv.add_argument("--port", type=int)
    srv.add_argument("--device", choices=DEVICE_CHOICES)
    srv.add_argument("--api-key", action="append", help="require this Bearer key (repeatable)")
    srv.add_argument("--num-slots", type=int, help="state pool slots")
    srv.add_argument("--compile", choices=["auto", "on", "off"], help="compile the decode step (default auto)")
    srv.add_argument("--dtype", choices=DTYPE_CHOICES, help="weights' dtype (default float32; state stays fp32)")
    srv.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(func=cmd_serve)

    train = sub.add_parser("train", help="prepare the corpus and tokenizer, train, write an HF checkpoint")
    train.add_argument("--config", required=True, help="configs/train/NAME.yaml")
    train.add_argument("--out-dir", help="override the config's out_dir")
    train.add_argument("--max-steps", type=int, help="override optim.max_steps")
    train.add_argument("--threads", type=int, help="torch CPU threads")
    train.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    train.set_defaults(func=cmd_train)

    evaluate = sub.add_parser("eval", help="held-out bits per byte of a checkpoint")
    evaluate.add_argument("--model", help="checkpoint directory (default: the shipped checkpoint)")
    evaluate.add_argument("--window", type=int, help="score independent windows of N tokens (default: carry the state through each work)")
    evaluate.add_argument("--corpus-dir", default="data/corpus")
    evaluate.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    evaluate.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="weights' dtype")
    evaluate.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="load-test a running server over HTTP/SSE")
    from server.bench.cli import add_arguments, run as run_bench

    add_arguments(bench)
    bench.set_defaults(func=run_bench)

    info = sub.add_parser("info", help="print the model's config, parameter count and state bytes per session")
    model_args(info)
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ValidationError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
