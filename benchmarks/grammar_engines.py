"""The grammar engines for structured outputs compared on the shipped tokenizer (issue 32): llguidance (what
linserve uses), xgrammar and outlines-core — compile time per JSON schema and the time to compute one token
mask, along a random walk of allowed tokens. Each engine is imported only if installed (`pip install xgrammar
outlines-core` to compare; linserve needs only llguidance).

    python benchmarks/grammar_engines.py [--out benchmarks/results/grammar_engines.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import emit  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number"}},
     "required": ["color", "score"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "integer"}}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
]
STEPS = 64


def walk(fill, allowed_of, advance, steps: int) -> list[float]:
    """Times (s) of `fill()` (computing the next mask in the engine's own form) along a random walk of allowed
    tokens (`allowed_of()` reads the mask, untimed)."""
    rng, times = random.Random(0), []
    for _ in range(steps):
        started = time.perf_counter()
        fill()
        times.append(time.perf_counter() - started)
        allowed = allowed_of()
        if not allowed:
            break
        if not advance(rng.choice(allowed)):
            break
    return times


def unpack(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.reshape(-1)[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (V/32, 32)
    return bits.reshape(-1)[:vocab].nonzero()[:, 0].tolist()


def llguidance_engine(tokenizer, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    result = []
    for schema in SCHEMAS:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        compiled = time.perf_counter() - started
        mask = lgt.allocate_token_bitmask(1, vocab)

        result.append((compiled, walk(lambda m=matcher, k=mask: lgt.fill_next_token_bitmask(m, k, 0),
                                      lambda k=mask: unpack(k, vocab),
                                      lambda t, m=matcher: m.consume_token(t) and not m.is_stopped(), STEPS)))
    return summary(result)


def xgrammar_engine(tokenizer, vocab: int) -> dict:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    result = []
    for schema in SCHEMAS:
        started = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        compiled = time.perf_counter() - started
        mask = xgr.allocate_token_bitmask(1, vocab)

        result.append((compiled, walk(lambda m=matcher, k=mask: m.fill_next_token_bitmask(k, 0),
                                      lambda k=mask: unpack(k, vocab),
                                      lambda t, m=matcher: m.accept_token(t) and not m.is_terminated(), STEPS)))
    return summary(result)


def outlines_engine(tokenizer, vocab: int) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    tokens: dict[str, list[int]] = {}
    for token, index in tokenizer.get_vocab().items():
        if index != tokenizer.eos_token_id:
            text = tokenizer.convert_tokens_to_string([token])
            tokens.setdefault(text, []).append(index)
    vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)
    result = []
    for schema in SCHEMAS:
        started = time.perf_counter()
        guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary))
        compiled = time.perf_counter() - started

        def advance(token, g=guide):
            g.advance(token)
            return not g.is_finished()

        result.append((compiled, walk(lambda g=guide: g.get_tokens(), lambda g=guide: list(g.get_tokens()), advance,
                                      STEPS)))
    return summary(result)


def summary(result) -> dict:
    compile_ms = [1e3 * c for c, _ in result]
    mask_us = [1e6 * statistics.median(times) for _, times in result if times]
    return {"compile_ms_median": round(statistics.median(compile_ms), 2), "compile_ms_max": round(max(compile_ms), 2),
            "mask_us_median": round(statistics.median(mask_us), 1), "mask_us_max": round(max(mask_us), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "model/checkpoints/default"))
    parser.add_argument("--out")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = len(tokenizer)
    result: dict = {"vocab": vocab, "schemas": len(SCHEMAS), "steps": STEPS, "engines": {}}
    for name, engine in (("llguidance", llguidance_engine), ("xgrammar", xgrammar_engine),
                         ("outlines-core", outlines_engine)):
        try:
            result["engines"][name] = engine(tokenizer, vocab)
        except ImportError:
            result["engines"][name] = "not installed"
    emit(result, args.out)


if __name__ == "__main__":
    main()
