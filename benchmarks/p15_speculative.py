"""SPEC P15 — speculative decoding: greedy tokens/s at 1 stream ≥ 1.5× without speculation (≥ 2× on a workload
whose drafts are accepted ≥ 70%), output identical; never below 0.97× at 8 and 32 streams.

One `linserve serve` (the shipped model; `--speculative ngram`, or `draft` with `--draft-model DIR`, so that the
verification (and drafting) programs are compiled at start, the decode step as `serve` compiles it); every
request names its method (`speculative: {"method": "off" | "ngram" | "draft"}`), so the methods share the server,
its programs and the machine, and run interleaved: each round runs every method once per load. No draft model
is shipped: `draft` is measured only with `--draft-model` (e.g. `configs/train/draft.yaml`'s, `runs/draft/final`).
Workloads, greedy:
- `shakespeare`: generated Shakespeare — 48-token openings taken from the validation plays, 256 tokens
  generated (128 at 8 and 32 streams);
- `quote`: a passage of about 160 tokens followed by its own first line: the model goes on quoting it, which
  prompt lookup drafts from the prompt (the kind of workload — editing, extraction, quoting — n-gram drafting
  is for);
- `shakespeare-long` (1 stream only): the same openings, 1,024 tokens generated — a small model's long greedy
  text comes back to its own lines, which prompt lookup drafts (a short generation is mostly the novel part
  before it does: the 256-token one is nearer the acceptance a shorter answer gets).
Before the rounds every load runs once with speculation and the verification buckets it asked for are built (the
server as it serves from then on). tokens/s = completion tokens / wall time of the load (every stream starts at
once); a method's ratio is the
median over rounds of its tokens/s over `off`'s in the same round (pairs run back to back, so the machine's
drift falls on both); acceptance = accepted /
drafted tokens from the server's counters over that method's loads; `identical`: every speculative output
equals the output without speculation.

    python benchmarks/p15_speculative.py [--rounds 3] [--k K] [--compare-k 4] [--draft-model DIR] [--quick]
                                         [--out FILE]

`--compare-k 4`: ngram requests asking for at most 4 drafts a step (`speculative.k`) measured too, in the same
rounds on the same server — a width side by side with the server's own.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import (  # noqa: E402
    add_compile_argument,
    add_device_argument,
    compile_settled,
    emit,
    steps_settled,
    wait_until_up,
)
from serving_overhead import COMPILE_TIMEOUT_S, start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.model.training.corpus import load_corpus  # noqa: E402

ALL_METHODS = ("off", "ngram", "draft")
ONE_STREAM, ACCEPTED_WELL, NEVER_BELOW = 1.5, 2.0, 0.97


def settled(body: dict) -> bool:
    """Nothing left to compile: the decode step and the prefill program (compile_settled), the verification and
    the draft model's step."""
    spec = body.get("speculation") or {}
    return compile_settled(body) and steps_settled(
        [*(spec.get("verify_steps") or {}).values(), (spec.get("draft_model") or {}).get("draft_step")])


def prompts(corpus_dir: str, client: httpx.Client, count: int, seed: int) -> dict[str, list[str]]:
    """`count` prompts of each workload from the validation plays (never trained on)."""
    plays = list(load_corpus(corpus_dir).validation.values())
    rng = random.Random(seed)
    lines = [line for play in plays for line in play.splitlines() if line.strip()]
    out: dict[str, list[str]] = {"shakespeare": [], "quote": []}
    while len(out["shakespeare"]) < count:
        start = rng.randrange(len(lines) - 40)
        text = "\n".join(lines[start : start + 40])
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"][:48]
        out["shakespeare"].append(client.post("/detokenize", json={"tokens": ids}).json()["prompt"])
    while len(out["quote"]) < count:
        start = rng.randrange(len(lines) - 60)
        passage = "\n".join(lines[start : start + 60])
        ids = client.post("/tokenize", json={"prompt": passage}).json()["tokens"][:160]
        passage = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        first = passage.split("\n")[0]
        out["quote"].append(f"{passage}\n\n{first}\n")
    out["shakespeare-long"] = out["shakespeare"]
    return out


def counters(client: httpx.Client) -> tuple[float, float]:
    text = client.get("/metrics").text
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    return value("linserve_spec_draft_tokens_total"), value("linserve_spec_accepted_tokens_total")


def speculative_field(method: str) -> dict:
    """A method's `speculative` field: "off", "ngram", "draft", or "ngram-k4" (ngram, at most 4 drafts a step)."""
    name, _, k = method.partition("-k")
    return {"method": name, **({"k": int(k)} if k else {})}


def load(client: httpx.Client, texts: list[str], method: str, max_tokens: int) -> tuple[float, list[str], int]:
    """Every prompt at once, one stream each: (tokens/s, texts, completion tokens)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "speculative": speculative_field(method)}

    def one(text: str) -> tuple[str, int]:
        response = client.post("/v1/completions", json={**body, "prompt": text})
        response.raise_for_status()
        data = response.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(one, texts))
    wall = time.perf_counter() - started
    tokens = sum(n for _, n in results)
    return tokens / wall, [text for text, _ in results], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--corpus-dir", default="data/corpus")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--k", type=int, help="the server's --speculative-k [default: the server's own]")
    parser.add_argument("--compare-k", type=int, nargs="*", default=[],
                        help="also measure ngram requests asking for at most this many drafts a step (their "
                             "`speculative.k`), side by side on the same server (not in the verdicts)")
    parser.add_argument("--draft-model", help="a draft model's checkpoint: measure `draft` too")
    parser.add_argument("--port", type=int, default=8798)
    parser.add_argument("--quick", action="store_true", help="1 round, 1 and 2 streams, 24 tokens, eager (tests)")
    parser.add_argument("--out")
    add_compile_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    methods = ALL_METHODS if args.draft_model else ALL_METHODS[:2]
    speculative = methods[1:]  # (the verdicts': the server's k)
    methods = (*methods, *(f"ngram-k{k}" for k in args.compare_k))
    long_tokens, short_tokens, longest_tokens = 256, 128, 1024
    if args.quick:
        args.rounds, args.compile, streams, long_tokens, short_tokens, longest_tokens = 1, "off", [1, 2], 24, 16, 32
    server = start_server(args.model, args.port, 64, compile=args.compile, device=args.device,
                          extra=["--log-level", "warning", *(["--speculative-k", str(args.k)] if args.k else []),
                                 "--session-store", "none",
                                 *(["--speculative", "draft", "--draft-model", args.draft_model] if args.draft_model
                                   else ["--speculative", "ngram"])])
    try:
        wait_until_up(server, f"http://127.0.0.1:{args.port}/ready", "linserve serve", COMPILE_TIMEOUT_S, settled)
        client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=1200)
        work = prompts(args.corpus_dir, client, max(streams), seed=0)
        server_k = client.get("/ready").json()["speculation"]["k"]
        load(client, work["shakespeare"][:1], "off", 8)  # warm-up

        def loads():
            for workload, texts in work.items():
                for n in streams if workload != "shakespeare-long" else [min(streams)]:
                    yield workload, texts, n, (longest_tokens if workload == "shakespeare-long"
                                               else long_tokens if n == 1 else short_tokens)

        # speculation times each verification width once at each batch size it meets (eagerly where its bucket is
        # not built) and asks for the buckets where it would pay: every load once before the rounds, and those
        # buckets built, so the rounds measure the server as it serves from then on — not a one-off eager probe,
        # nor a compile taking a core in the background while both methods are timed
        for _, texts, n, max_tokens in loads():
            load(client, texts[:n], speculative[0], max_tokens)
        wait_until_up(server, f"http://127.0.0.1:{args.port}/ready", "linserve serve", COMPILE_TIMEOUT_S, settled)
        results: dict = {}
        for workload, texts, n, max_tokens in loads():
            rates = {m: [] for m in methods}
            drafted = {m: [0.0, 0.0] for m in methods}
            outputs: dict[str, list[str]] = {}
            for round_number in range(args.rounds):
                order = methods if round_number % 2 == 0 else methods[::-1]
                for method in order:
                    before = counters(client)
                    rate, texts_out, _ = load(client, texts[:n], method, max_tokens)
                    after = counters(client)
                    rates[method].append(rate)
                    drafted[method][0] += after[0] - before[0]
                    drafted[method][1] += after[1] - before[1]
                    outputs.setdefault(method, texts_out)
            entry = {"max_tokens": max_tokens,
                     "tokens_per_s": {m: [round(r, 1) for r in rates[m]] for m in methods}}
            for method in methods[1:]:
                tried, kept = drafted[method]
                paired = [r / o for r, o in zip(rates[method], rates["off"])]  # each round's own ratio
                entry[method] = {"ratio": statistics.median(paired),
                                 "acceptance": kept / tried if tried else None,
                                 "drafted": int(drafted[method][0]),
                                 "identical": outputs[method] == outputs["off"]}
            results.setdefault(workload, {})[f"streams_{n}"] = entry
    finally:
        server.terminate()
        server.wait(30)

    def best(workload: str, n: int) -> tuple[str, dict]:
        entry = results[workload][f"streams_{n}"]
        return max(((m, entry[m]) for m in speculative), key=lambda item: item[1]["ratio"])

    verdicts = {}
    one = min(streams)
    method, entry = best("shakespeare", one)
    verdicts["one_stream"] = {"workload": "shakespeare", "method": method, "ratio": entry["ratio"],
                              "target": f">= {ONE_STREAM}x", "pass": entry["ratio"] >= ONE_STREAM}
    well = [(w, m, e) for w in results for m in speculative
            for e in [results[w][f"streams_{one}"][m]] if (e["acceptance"] or 0) >= 0.7]
    if well:
        w, m, e = max(well, key=lambda item: item[2]["ratio"])
        verdicts["accepted_well"] = {"workload": w, "method": m, "acceptance": e["acceptance"], "ratio": e["ratio"],
                                     "target": f">= {ACCEPTED_WELL}x where >= 70% accepted",
                                     "pass": e["ratio"] >= ACCEPTED_WELL}
    for n in [s for s in streams if s > one]:
        worst = min(results[w][f"streams_{n}"][m]["ratio"] for w in results if f"streams_{n}" in results[w]
                    for m in speculative)
        verdicts[f"streams_{n}"] = {"ratio": worst, "target": f">= {NEVER_BELOW}x (every workload and method)",
                                    "pass": worst >= NEVER_BELOW}
    identical = all(results[w][s][m]["identical"] for w in results for s in results[w] for m in speculative)
    verdicts["identical"] = {"measured": identical, "target": "every output equals plain decoding's",
                             "pass": identical}
    emit({"compile": args.compile, "k": server_k, "compare_k": args.compare_k, "rounds": args.rounds,
          "draft_model": args.draft_model, "results": results, "P15": verdicts}, args.out)


if __name__ == "__main__":
    main()
