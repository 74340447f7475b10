"""What each compiled bucket adds to a server's memory, beside the one copy of the weights it serves.

    python benchmarks/bucket_memory.py [--vocab 32000] [--d-model 1024] [--layers 2] [--sizes 1 2 4 8]
                                       [--checkpoint DIR] [--cache DIR] [--out FILE]

A model whose embedding table is large (by default 32,000 tokens × 1,024 in bf16: 64 MB, as fla's 340M checkpoints
publish it; two layers, so each bucket builds in a minute) is served the way `linserve serve` serves it: bf16, its
projections' originals released once packed (`weights.keep_one_copy`), the decode step compiled for every bucket of
`--sizes`. The process's RSS (`/proc/self/smaps_rollup`: all, anonymous, file-backed) is read after an eager step and
again once every bucket is loaded and has run. A program that froze its own copy of the table would add it twice a
bucket: AOTInductor copies its constants into memory of its own at load (anonymous), reading them from the
library's mapped pages (file-backed). `--checkpoint` measures a real one instead (`--quick`: the shipped model,
bucket 1). Measure another tree by putting it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe, emit  # noqa: E402

from linserve.model import LinearGPT, ModelConfig  # noqa: E402
from linserve.model.loading import DEFAULT_CHECKPOINT, load_model  # noqa: E402
from linserve.model.weights import keep_one_copy  # noqa: E402
from linserve.server.engine.compile.compiled_decode import DecodeStep  # noqa: E402
from linserve.server.engine.cpu_threads import plan_threads, weight_bytes  # noqa: E402
from linserve.server.engine.sampling import SlotSampling  # noqa: E402
from linserve.server.engine.state_pool import StatePool  # noqa: E402

CPU = torch.device("cpu")


def rss_mb() -> dict[str, float]:
    """This process's resident memory in MB: all of it, anonymous, and file-backed (the rest)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            key, _, value = line.partition(":")
            if key in ("Rss", "Anonymous"):
                fields[key] = int(value.split()[0]) / 1024
    return {"all": fields["Rss"], "anonymous": fields["Anonymous"], "file": fields["Rss"] - fields["Anonymous"]}


def served_model(args) -> torch.nn.Module:
    if args.checkpoint:
        return load_model(Path(args.checkpoint), CPU, torch.bfloat16).model
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8,
                         conv_kernel=3, decay=True, chunk_size=16)
    return LinearGPT(config).to(torch.bfloat16).eval()


def measure(args) -> dict:
    model = served_model(args)
    # on the decode thread count a server gives this model (a program's key holds it: --quick's bucket is then the
    # one the suite's compiled-decode tests build, one build a run)
    torch.set_num_threads(plan_threads(None, weight_bytes=weight_bytes(model)).threads)
    keep_one_copy(model)  # as the server holds it: the projections only packed
    vocab, slots = model.config.vocab_size, max(args.sizes)  # (--quick: 1 slot, bucket 1: the suite's shipped artifact)
    step = DecodeStep(model, StatePool(model, slots, CPU), SlotSampling(slots, vocab, CPU), CPU, "on",
                      max_rows=max(args.sizes), cache_dir=args.cache, autotune=False)
    step.sizes = sorted(args.sizes)
    with torch.inference_mode():
        step([1], [0], [0])  # eager, before any bucket
    before = rss_mb()
    step.start()
    if not step.wait_compiled(3600):
        raise SystemExit(f"the buckets were not built: {step.status}")
    with torch.inference_mode():
        for size in step.ready_sizes:
            step(list(range(1, size + 1)), list(range(size)), [1] * size)
    after = rss_mb()
    # the tables counted here, as weights.read_as_themselves finds them (a baseline tree through PYTHONPATH lacks it)
    table = sum(module.weight.numel() * module.weight.element_size() for module in model.modules()
                if isinstance(module, torch.nn.Embedding)) / 2**20
    added = {key: round(after[key] - before[key], 1) for key in after}
    step.close()
    return {"sizes": step.ready_sizes, "vocab": vocab, "table_mb": round(table, 1),
            "rss_before_buckets_mb": {k: round(v, 1) for k, v in before.items()},
            "rss_after_buckets_mb": {k: round(v, 1) for k, v in after.items()}, "added_mb": added,
            "added_per_bucket_mb": round(added["all"] / len(step.ready_sizes), 1),
            "tables_per_bucket": round(added["all"] / len(step.ready_sizes) / table, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--checkpoint", help="a checkpoint directory instead of the random model")
    parser.add_argument("--cache", help="the compile cache (default: a new temporary directory)")
    parser.add_argument("--quick", action="store_true", help="the shipped model, bucket 1")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.checkpoint, args.sizes = args.checkpoint or str(DEFAULT_CHECKPOINT), [1]
    with tempfile.TemporaryDirectory() as temporary:
        args.cache = args.cache or temporary
        result = measure(args)
    emit({"bucket_memory": result, "machine": describe(CPU)}, args.out)


if __name__ == "__main__":
    main()
