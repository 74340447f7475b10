"""`linserve` command line: serve, generate, train, eval, bench, info.

Only the standard library is imported here: torch, transformers and the server load inside the command
that needs them, so `linserve --help` and `--version` answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from linserve.server.version import package_version

SOFTMAX_EVAL_WINDOW = 1024  # a KV cache over a whole play would be quadratic; softmax is scored in windows


def checkpoint_dir(model: str | None, files: tuple[str, ...] = ("config.json",),
                   tokenizer_files: tuple[str, ...] | None = None) -> Path:
    """The checkpoint directory to use (the shipped one by default); a clear error if it is not one. Its
    tokenizer: any layout `serve` reads unless `tokenizer_files` narrows it."""
    from linserve.server.preflight import TOKENIZER_FILES, check_checkpoint

    check_checkpoint(model, files, TOKENIZER_FILES if tokenizer_files is None else tokenizer_files)
    if model is None:
        from linserve.model.loading import DEFAULT_CHECKPOINT

        return DEFAULT_CHECKPOINT
    return Path(model)


def _load_for_generation(path: Path, device):
    from linserve.model.checkpoint import load_served

    return load_served(path, device)


def check_sampling(**values) -> None:
    """The server's bounds for these sampling parameters (SamplingParams is where they live), as flags."""
    from linserve.server.engine.types import EngineError, SamplingParams

    try:
        SamplingParams(**values)
    except EngineError as error:
        raise ValueError(f"--{(error.param or '').replace('_', '-')}: {error.message}") from None


def check_device(name: str) -> None:
    """`cuda` on a machine without one fails here, after torch alone has loaded (about a second), before the
    model and transformers do: one line, at once."""
    if name == "cuda":
        from linserve.server.preflight import check_gpu_driver

        check_gpu_driver(name)  # no driver at all: at once
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but no CUDA device is available")


def cmd_generate(args: argparse.Namespace) -> int:
    # the arguments are checked before torch loads (seconds): a typo is reported at once
    check_sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    check_device(args.device)
    path = checkpoint_dir(args.model)
    from linserve.model.generate import generate_tokens
    from linserve.model.loading import resolve_device

    device = resolve_device(args.device)
    model, tokenizer = _load_for_generation(path, device)
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
    print(
        f"[{len(generated)} tokens in {elapsed:.2f}s, {len(generated) / max(elapsed, 1e-9):.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    check_device(args.device)
    path = checkpoint_dir(args.model)
    from linserve.model.loading import resolve_device

    device = resolve_device(args.device)
    model, _ = _load_for_generation(path, device)
    config = model.config
    if hasattr(config, "raw"):  # an fla family: its type and the fields that shape it
        print(f"model_type={config.model_type} attention={config.attention}")
        print(f"layers={config.n_layers} hidden_size={config.hidden_size} heads={config.num_heads} "
              f"kv_heads={config.num_kv_heads} key_dim={config.key_dim} value_dim={config.value_dim} "
              f"vocab={config.vocab_size}")
    else:
        print(
            f"attention={config.attention} feature_map={config.feature_map} decay={config.decay} "
            f"conv_kernel={config.conv_kernel}"
        )
        print(f"layers={config.n_layers} d_model={config.d_model} heads={config.n_heads} vocab={config.vocab_size}")
    print(f"parameters={model.num_parameters()}")
    print(f"state_bytes_per_session={model.state_bytes()}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    check_device(args.device)
    import torch

    from linserve.model.loading import resolve_device
    from linserve.model.training.trainer import TrainConfig, Trainer

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
    check_device(args.device)
    from tokenizers import Tokenizer

    from linserve.model import projection
    from linserve.model.loading import load_model, resolve_device, resolve_dtype
    from linserve.model.training.corpus import load_corpus
    from linserve.model.training.evaluate import bits_per_byte

    device = resolve_device(args.device)
    path = checkpoint_dir(args.model, tokenizer_files=("tokenizer.json",))
    dtype = resolve_dtype(args.dtype, device)
    projection.use_quantization(args.quantization, device, dtype)
    lm = load_model(path, device, dtype)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    window = args.window
    if window is None and lm.model.config.attention == "softmax":
        window = SOFTMAX_EVAL_WINDOW
        print(f"note: softmax model: scoring independent windows of {window} tokens", file=sys.stderr)
    works = dict(list(load_corpus(args.corpus_dir).validation.items())[: args.max_works])
    result = bits_per_byte(lm.model, tokenizer, works, window=window, progress=ProgressLine("eval", "tokens"))
    report = {
        "model": str(path),
        "dtype": str(next(lm.parameters()).dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "window": window,
        "works": list(works),
        "bits_per_byte": result.bits_per_byte,
        "nats_per_token": result.nats_per_token,
        "tokens": result.tokens,
        "bytes": result.bytes,
        "tokens_per_second": result.tokens_per_second,
    }
    print(json.dumps(report, indent=2))
    return 0


class ProgressLine:
    """`(done, total, seconds)` → progress on stderr — rewritten in place on a terminal (at most 4 times a
    second), a plain line every 10% otherwise (logs) — so stdout stays machine-readable."""

    def __init__(self, label: str, unit: str, stream=None) -> None:
        self.label, self.unit, self.stream = label, unit, stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.shown_at, self.shown_tenth = -1.0, -1

    def __call__(self, done: int, total: int, seconds: float) -> None:
        finished = done >= total
        tenth = 10 * done // max(total, 1)
        if self.terminal and not finished and seconds - self.shown_at < 0.25:
            return
        if not self.terminal and tenth == self.shown_tenth:
            return
        self.shown_at, self.shown_tenth = seconds, tenth
        rate = done / max(seconds, 1e-9)
        left = (total - done) / rate if rate > 0 else float("inf")
        line = (f"{self.label}: {done:,} / {total:,} {self.unit} ({100 * done / max(total, 1):.0f}%), "
                f"{rate:,.0f} {self.unit}/s, " + ("done" if finished else f"~{left:.0f} s left"))
        if self.terminal:
            self.stream.write("\r" + line.ljust(79) + ("\n" if finished else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def cmd_compile(args: argparse.Namespace) -> int:
    """Build the decode step's compile cache ahead of `serve` (images, init containers): every batch bucket
    `serve` would compile with the same settings, into the same cache directory, in the foreground — and, with
    `--speculative ngram|draft`, the verification program's buckets for `--speculative-k` drafts too (with
    `draft`, also the draft model's drafting program); on a CPU the prefill program's (prefill_program_tokens)."""
    from linserve.model import projection
    from linserve.model.checkpoint import load_served
    from linserve.model.interface import fixed_state
    from linserve.model.loading import resolve_device, resolve_dtype
    from linserve.server.engine.compile.compiled_decode import DecodeStep
    from linserve.server.engine.decode_program import DECODE, verify_kind
    from linserve.server.engine.model_kind import served_prefill_kind
    from linserve.server.engine.prefill_program import PREFILL_ROWS, PrefillKind
    from linserve.server.engine.sampling import SlotSampling
    from linserve.server.engine.spec.speculation import verify_widths
    from linserve.server.engine.state_pool import StatePool
    from linserve.server.loading import engine_config, load_draft
    from linserve.server.settings import Settings

    settings = Settings.load(args.config, **{name: getattr(args, name, None) for name in Settings.model_fields})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = resolve_device(settings.device)
    from linserve.server.engine.cpu_threads import apply_threads, weight_bytes

    dtype = resolve_dtype(settings.dtype, device)
    projection.use_quantization(settings.quantization, device, dtype)  # the programs' projections, as `serve`
    model, _ = load_served(checkpoint_dir(settings.model), device, dtype)  # the model `serve` serves
    # the count `serve` will run with (Inductor builds it into the kernels)
    apply_threads(settings.threads, settings.prefill_threads, weight_bytes(model))
    if not fixed_state(model):
        print("error: only linear-attention models have a compiled decode step", file=sys.stderr)
        return 2
    # the programs read the pool's and the samplers' buffers: compiled for the slot count `serve` would have
    slots = engine_config(settings, model).num_slots
    sampling = SlotSampling(slots, model.config.vocab_size, device)
    pool = StatePool(model, slots, device)
    programs = [(model, pool, DECODE)]
    if settings.speculative != "off":
        programs += [(model, pool, verify_kind(width)) for width in sorted(verify_widths(settings.speculative_k),
                                                                            reverse=True)]
    if settings.speculative == "draft":
        from linserve.model.checkpoint import load_tokenizer
        from linserve.server.engine.spec.draft_model import DraftKind

        path = checkpoint_dir(settings.model)
        draft = load_draft(settings, model, load_tokenizer(path), device)
        programs.append((draft, StatePool(draft, slots, device), DraftKind(f"draft{settings.speculative_k}")))
    prefill = served_prefill_kind(model, settings.prefill_program_tokens, device)
    if prefill is not None:
        programs.append((model, pool, prefill))
    statuses = []
    for program_model, program_pool, kind in programs:
        rows = PREFILL_ROWS if isinstance(kind, PrefillKind) else settings.max_batch_tokens
        step = DecodeStep(program_model, program_pool, sampling, device, "on", min(slots, rows),
                          settings.compile_cache_dir, settings.compile_autotune, kind=kind,
                          cache_max_gb=settings.compile_cache_max_gb)
        step.start()
        step.wait_compiled()
        seconds = ", ".join(f"{size}: {s:.1f} s" for size, s in step.compile_seconds.items())
        print(f"{step.label} {step.status}: buckets {step.ready_sizes} of {step.sizes} ({seconds}) in {step.cache_dir}")
        statuses.append(step.status)
        step.close(wait=True)
    exit_now(0 if all(status == "compiled" for status in statuses) else 1)


def cmd_serve(args: argparse.Namespace) -> int:
    from linserve.server.settings import Settings

    settings = Settings.load(args.config, **{name: getattr(args, name) for name in Settings.model_fields})
    from linserve.server.preflight import preflight

    preflight(settings)  # port, model directory, device: one-line errors before anything heavy loads
    from linserve.server.serve import serve

    status = serve(settings)  # the lifespan has stopped the engine and flushed every session by now
    exit_now(status)


def exit_now(status: int) -> NoReturn:
    """End the process once its output is flushed, without tearing down the interpreter: that teardown costs
    2-3 s of garbage collection (torch, transformers) and runs native destructors (a loaded AOTInductor
    program's, torch's thread pools) in an order that can abort the process with "terminate called without
    an active exception" after its work succeeded."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# what `linserve compile` reads: the decode program depends on these alone (the config file may hold the rest)
COMPILE_SETTINGS = ("model", "device", "dtype", "quantization", "num_slots", "state_memory_mb", "max_batch_tokens",
                    "compile_cache_dir", "compile_cache_max_gb", "compile_autotune", "threads", "speculative",
                    "speculative_k", "draft_model")


def add_setting_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per setting (or per setting in `only`), generated from `Settings` (name, type, choices,
    description and default come from there, the one place they live). Flags default to None ("not given") so
    that the environment and the config file still apply; the help shows the effective default."""
    import typing

    from linserve.server.settings import Settings

    for name, field in Settings.model_fields.items():
        if only is not None and name not in only:
            continue
        default = field.get_default(call_default_factory=True)
        shown = "none" if default in (None, []) else default
        text = f"{field.description or name.replace('_', ' ')} [default: {shown}]"
        kinds = [t for t in typing.get_args(field.annotation) or (field.annotation,) if t is not type(None)]
        kind = kinds[0] if kinds else str
        # values stay strings here: Settings parses and checks them, so a bad one gets the same one-line
        # message from a flag as from LINSERVE_* or the YAML file
        flag = f"--{name.replace('_', '-')}"
        if name == "api_keys":  # a list: one flag per key
            parser.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                                help=text + "; repeatable")
        elif typing.get_origin(field.annotation) is typing.Literal:
            parser.add_argument(flag, metavar="{" + ",".join(typing.get_args(field.annotation)) + "}", help=text)
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, metavar=getattr(kind, "__name__", "str").upper(), help=text)


class DefaultsFormatter(argparse.HelpFormatter):
    """Shows a flag's default as `[default: X]` (one style everywhere) unless it has none (None: 'not given',
    resolved later) or its help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "[default:" in text or not action.option_strings:
            return text
        return f"{text} [default: {action.default}]"


def build_parser() -> argparse.ArgumentParser:
    formatter = DefaultsFormatter
    parser = argparse.ArgumentParser(
        prog="linserve", description="Serve causal linear-attention language models.", formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"linserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=formatter)

    import typing

    from linserve.server.settings import Settings

    # the choices the settings allow (a test keeps them equal to model.loading's); read here, not repeated
    devices, dtypes, quantizations = (typing.get_args(Settings.model_fields[name].annotation)
                                      for name in ("device", "dtype", "quantization"))

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="checkpoint directory [default: the shipped checkpoint]")
        p.add_argument("--device", choices=devices, default="auto", help="auto: cuda when available")

    gen = command("generate", "stream a completion of PROMPT to stdout")
    gen.add_argument("prompt", help="the text to continue")
    model_args(gen)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--max-tokens", type=int, default=200, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens")
    gen.set_defaults(func=cmd_generate)

    srv = command("serve", "serve a model over HTTP (OpenAI-compatible API + sessions)")
    srv.add_argument("--config", help="YAML settings file [default: configs/server.yaml if present]")
    add_setting_flags(srv)
    srv.set_defaults(func=cmd_serve)

    train = command("train", "prepare the corpus and tokenizer, train, write an HF checkpoint")
    train.add_argument("--config", required=True, help="configs/train/NAME.yaml")
    train.add_argument("--out-dir", help="override the config's out_dir")
    train.add_argument("--max-steps", type=int, help="override optim.max_steps")
    train.add_argument("--threads", type=int, help="torch CPU threads [default: torch's choice]")
    train.add_argument("--device", choices=devices, default="auto", help="auto: cuda when available")
    train.set_defaults(func=cmd_train)

    evaluate = command("eval", "held-out bits per byte of a checkpoint")
    model_args(evaluate)
    evaluate.add_argument(
        "--window", type=int, help="score independent windows of N tokens [default: carry the state through each work]"
    )
    evaluate.add_argument("--corpus-dir", default="data/corpus", help="where the corpus is (downloaded if absent)")
    evaluate.add_argument("--dtype", choices=dtypes, default="float32", help="weights' dtype")
    evaluate.add_argument("--quantization", choices=quantizations, default="none",
                          help="int8: the projections' weights in int8 (with --dtype bfloat16, on a CPU)")
    evaluate.add_argument("--max-works", type=int, help="score only the first N held-out works [default: all]")
    evaluate.set_defaults(func=cmd_eval)

    bench = command("bench", "load-test a running server over HTTP/SSE")
    from linserve.server.bench.cli import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    comp = command("compile", "compile the decode step's batch buckets into the compile cache ahead of serve")
    comp.add_argument("--config", help="YAML settings file [default: configs/server.yaml if present]")
    add_setting_flags(comp, COMPILE_SETTINGS)
    comp.set_defaults(func=cmd_compile)

    info = command("info", "print the model's config, parameter count and state bytes per session")
    model_args(info)
    info.set_defaults(func=cmd_info)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    from linserve.server.bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own usage and error, not the top level's
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as error:  # start-up errors: one line, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
