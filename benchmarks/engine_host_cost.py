"""The engine thread's host time per decode step and per row, and what the program's memory traffic does to it
(issue 57's "≤ 60 µs a step + ≤ 4 µs a row").

In process, compiled (the server's settings), top-k 50: B streams decode and every decode step's time outside
its program is read from the engine's StepStats — `in_step` (the step's own Python: the rows' tokens in, the
draw read, every row's output; what `engine_inprocess.py` reports) and `loop` (everything the engine thread does
between two programs: that, plus the commands, the scheduler and the gauges) — per row, and fitted as
a + b·B from the smallest and largest B.

Two models side by side, engines alive together, runs alternating: the model (default: the shipped one) and its
**tiny twin** — the same tokenizer and vocabulary, one 64-wide layer, random weights — whose program leaves the
host's caches as it found them (what a GPU's program does to them). The same Python runs around both, so the gap
is what the model's program evicts from the engine thread's caches; `--flush-mb` reads a buffer of that size on
the engine thread after every program (a big model's traffic, made on purpose) to show it on the twin too.

    python benchmarks/engine_host_cost.py [--rows 1 32] [--tokens 512] [--reps 3] [--flush-mb 0 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import add_compile_argument, describe, emit, resolve_device, wait_programs
from engine_inprocess import DecodeTotals, run_streams
from transformers import AutoTokenizer

from linserve.model.loading import DEFAULT_CHECKPOINT, resolve_dtype
from linserve.server.engine import Engine, EngineConfig
from linserve.server.engine.compile import compiled_decode
from linserve.server.loading import load_model
from linserve.server.settings import Settings

SAMPLING = {"top_k": 50}  # the shipped checkpoint's generation default, as a server applies it


class LoopClock(DecodeTotals):
    """DecodeTotals plus the engine thread's time between two decode programs (the loop), per row: summed over
    consecutive decode steps of the same batch (a step that prefills, or a batch that changed, starts again)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop_s, self.loop_rows, self._last = 0.0, 0, None

    def __call__(self, stats) -> None:
        super().__call__(stats)
        phase = getattr(stats, "phase", None)
        if phase == "decode":
            now = time.perf_counter()
            if self._last is not None and self._last[1] == stats.decode_tokens:
                self.loop_s += now - self._last[0] - stats.program_s
                self.loop_rows += stats.decode_tokens
            self._last = (now, stats.decode_tokens)
        elif phase is not None:
            self._last = None

    def restart(self) -> tuple[float, float, int, int]:
        """A new measurement: the loop's sums cleared, and the totals' mark."""
        self.loop_s, self.loop_rows, self._last = 0.0, 0, None
        return self.mark()


class AfterProgram:
    """Reads `buffer` (if any) on the engine thread after every decode program: what a bigger program's traffic
    leaves in the caches, on demand (inside the step's program time, so outside what is measured)."""

    buffer: np.ndarray | None = None

    @classmethod
    def install(cls) -> None:
        run = compiled_decode.DecodeStep.run

        def run_then_read(step, io_rows):
            outputs = run(step, io_rows)
            if cls.buffer is not None:
                cls.buffer.sum()
            return outputs

        compiled_decode.DecodeStep.run = run_then_read


def tiny_twin(model_dir: str, directory: Path) -> Path:
    """The model's tokenizer and vocabulary over one 64-wide layer of random weights (fp32 on disk, served in the
    engine's dtype)."""
    from tokenizers import Tokenizer

    from linserve.model import LinearGPT, ModelConfig
    from linserve.model.training.trainer import save_checkpoint

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=64, n_layers=1, n_heads=4)
    save_checkpoint(LinearGPT(config), tokenizer, directory, torch.float32)
    return directory


def measure(engine: Engine, clock: LoopClock, rows: int, tokens: int, tag: str) -> dict:
    mark = clock.restart()
    seconds, generated = run_streams(engine, rows, tokens, tag, sampling=SAMPLING)
    return {"in_step_us_per_row": clock.python_us_per_row(mark),
            "loop_us_per_row": 1e6 * clock.loop_s / max(clock.loop_rows, 1),
            "program_ms": clock.per_step_ms(mark)[0], "tokens_per_s": generated / seconds}


def fitted(per_row: dict[int, float]) -> dict:
    """a + b·B through the smallest and largest B's per-row figures (µs a step, µs a row)."""
    small, large = min(per_row), max(per_row)
    b = (large * per_row[large] - small * per_row[small]) / (large - small)
    return {"a_us_per_step": small * per_row[small] - b * small, "b_us_per_row": b}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per stream a run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--flush-mb", type=float, nargs="+", default=[0, 64],
                        help="after each program, read this many MB on the engine thread (0: nothing)")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="eager, 1 and 4 rows, 16 tokens, one round")
    parser.add_argument("--out")
    add_compile_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.reps, args.compile, args.flush_mb = [1, 4], 16, 1, "off", [0, 8]
    if len(set(args.rows)) < 2:
        parser.error("--rows needs two batch sizes or more (the fit)")
    device = resolve_device("cpu")
    dtype = resolve_dtype("auto", device)
    AfterProgram.install()
    scratch = tempfile.TemporaryDirectory()
    models = {"model": args.model, "tiny_twin": str(tiny_twin(args.model, Path(scratch.name)))}
    config = EngineConfig.from_settings(Settings(session_store="none", num_slots=args.slots, compile=args.compile))
    engines = {}
    try:
        for label, directory in models.items():
            clock = LoopClock()
            model = load_model(directory, device, dtype).model
            engine = Engine(model, AutoTokenizer.from_pretrained(directory), config, device, clock, dtype=dtype).start()
            engines[label] = (engine, clock)
            wait_programs(engine)
            run_streams(engine, max(args.rows), 16, f"warm-{label}", sampling=SAMPLING)
        runs: dict[tuple, list[dict]] = {}
        for rep in range(args.reps):  # every combination once a round, in the same order
            for label, (engine, clock) in engines.items():
                for flush in args.flush_mb:
                    AfterProgram.buffer = np.ones(int(flush * 2**20) // 8) if flush else None
                    for rows in args.rows:
                        runs.setdefault((label, flush, rows), []).append(
                            measure(engine, clock, rows, args.tokens, f"{label}-{flush}-{rows}-{rep}"))
                    AfterProgram.buffer = None
        programs = {label: engine.decode_step.describe() for label, (engine, _) in engines.items()}
    finally:
        for engine, _ in engines.values():
            engine.stop()
        scratch.cleanup()
    result = {**describe(device), "dtype": str(dtype), "models": models, "sampling": SAMPLING, "reps": args.reps,
              "tokens_per_stream": args.tokens, "programs": programs, "runs": {}}
    for label in models:
        for flush in args.flush_mb:
            key = f"{label} flush_mb={flush:g}"
            by_rows = {rows: {name: statistics.median(run[name] for run in runs[(label, flush, rows)])
                              for name in runs[(label, flush, rows)][0]} for rows in args.rows}
            result["runs"][key] = {
                "by_rows": by_rows,
                "in_step": fitted({rows: m["in_step_us_per_row"] for rows, m in by_rows.items()}),
                "loop": fitted({rows: m["loop_us_per_row"] for rows, m in by_rows.items()}),
            }
    emit(result, args.out)
    for key, run in result["runs"].items():
        print(f"{key}: in step a {run['in_step']['a_us_per_step']:.1f} µs + b {run['in_step']['b_us_per_row']:.2f}"
              f" µs a row; loop a {run['loop']['a_us_per_step']:.1f} + b {run['loop']['b_us_per_row']:.2f}")


if __name__ == "__main__":
    main()
