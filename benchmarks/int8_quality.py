"""int8 weights' quality (issue 55, item 4): what `quantization: int8` changes against the bf16 default.

1. The shipped model's held-out bits per byte, bf16 vs int8 (`linserve eval --dtype bfloat16 [--quantization
   int8]`, the first `--works` held-out works, state carried through each).
2. fla's 340M shapes (random weights, fla-style init: benchmarks/p17_families.py's checkpoints): over `--tokens`
   tokens of held-out text, the mean and largest |Δ log-prob| of the next token, and the mean over the whole
   vocabulary, int8 against bf16 — both through linserve's exact path (the kernel, bf16 activations).

    python benchmarks/int8_quality.py [--works 1] [--families linear_attn gla retnet gated_deltanet] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit  # noqa: E402
from p17_families import FAMILIES, make_checkpoint  # noqa: E402

from linserve.model import projection  # noqa: E402
from linserve.model.checkpoint import load_checkpoint  # noqa: E402
from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402


def bits_per_byte(works: int, quantization: str, corpus_dir: str) -> dict:
    command = [sys.executable, "-m", "linserve.server.cli", "eval", "--device", "cpu", "--dtype", "bfloat16",
               "--quantization", quantization, "--max-works", str(works), "--corpus-dir", corpus_dir]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def held_out_ids(count: int, corpus_dir: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    from linserve.model.training.corpus import load_corpus

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))
    text = "\n".join(load_corpus(corpus_dir).validation.values())
    return torch.tensor(tokenizer.encode(text)[:count + 1])  # (count + 1,)


@torch.no_grad()
def log_prob_shift(directory: Path, ids: torch.Tensor) -> dict:
    device = torch.device("cpu")
    logprobs = {}
    for weights in ("bf16", "int8"):
        projection.set_weight_format(weights)
        model = load_checkpoint(directory, device, torch.bfloat16)
        started = time.perf_counter()
        logits, _ = model(ids[None, :-1])  # (1, T, V)
        logprobs[weights] = torch.log_softmax(logits[0].float(), -1)  # (T, V)
        logprobs[f"{weights}_seconds"] = time.perf_counter() - started
        del model
    projection.set_weight_format("bf16")
    target = ids[1:, None]  # (T, 1)
    chosen = (logprobs["int8"].gather(1, target) - logprobs["bf16"].gather(1, target)).abs()  # (T, 1)
    whole = (logprobs["int8"] - logprobs["bf16"]).abs()  # (T, V)
    return {"tokens": int(target.shape[0]), "mean_abs_delta_next_token": chosen.mean().item(),
            "max_abs_delta_next_token": chosen.max().item(), "mean_abs_delta_vocabulary": whole.mean().item(),
            "bf16_next_token_logprob": logprobs["bf16"].gather(1, target).mean().item(),
            "seconds": {w: round(logprobs[f"{w}_seconds"], 1) for w in ("bf16", "int8")}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--works", type=int, default=1, help="held-out works for bits per byte")
    parser.add_argument("--tokens", type=int, default=256, help="held-out tokens scored at the 340M shapes")
    parser.add_argument("--families", nargs="+", default=["linear_attn", "gla", "retnet", "gated_deltanet"],
                        choices=list(FAMILIES))
    parser.add_argument("--corpus-dir", default="data/corpus")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    result = {"shipped_model": {}, "fla_340M": {}}
    for quantization in ("none", "int8"):
        report = bits_per_byte(args.works, quantization, args.corpus_dir)
        result["shipped_model"]["int8" if quantization == "int8" else "bf16"] = {
            key: report[key] for key in ("bits_per_byte", "tokens", "works", "tokens_per_second")}
    shipped = result["shipped_model"]
    shipped["delta_bits_per_byte"] = shipped["int8"]["bits_per_byte"] - shipped["bf16"]["bits_per_byte"]
    ids = held_out_ids(args.tokens, args.corpus_dir)
    for name in args.families:
        result["fla_340M"][name] = log_prob_shift(make_checkpoint(name), ids)
        print(name, result["fla_340M"][name], file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
