"""SPEC P8: state bytes per session equal the config's formula; RSS stays flat over a long generation.

    python benchmarks/memory.py [--tokens 65536] [--quick] [--out FILE]

Generates `--tokens` tokens in one sequence with the shipped model (recurrent decode, the state passed
along) and samples the process's resident set size; growth is measured from the end of a warm-up
(1,024 tokens) to the end.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import emit

from model.generate import decode_one_token, prefill
from model.loading import DEFAULT_CHECKPOINT, load_model
from server.engine.state_pool import StatePool

WARMUP_TOKENS = 1024


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = 2048
    model = load_model(DEFAULT_CHECKPOINT, torch.device("cpu")).model
    c = model.config
    formula = c.n_layers * 4 * (c.n_heads * c.d_feature * c.d_head + c.n_heads * c.d_feature + c.conv_window * c.d_model)
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
    result = {"P8": {
        "state_bytes": {"formula": formula, "config_state_bytes": model.state_bytes(), "pool_slot_bytes": pool.slot_bytes,
                        "actual_after_generation": state.nbytes(), "equal": formula == model.state_bytes()
                        == pool.slot_bytes == state.nbytes()},
        "rss": {"tokens": args.tokens, "after_warmup_mb": baseline / 2**20, "end_mb": end / 2**20,
                "growth": growth, "target": "<= 0.02", "pass": growth <= 0.02, "samples": samples},
        "tokens_per_s": args.tokens / (time.perf_counter() - started),
    }}
    emit(result, args.out)


if __name__ == "__main__":
    main()
