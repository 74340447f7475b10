"""SPEC P16 — conversation state: turn 50 of a 20,000-token conversation continued by `previous_response_id`
reaches its first token within 1.2× the TTFT of turn 2.

One `linserve serve` (the shipped model, a `dir:` store, the decode step as `serve` compiles it). A conversation of
`--turns` turns through `/v1/responses`, each turn a new user input of about `--input-tokens` tokens and a
`--output-tokens`-token answer, each continuing the previous response. TTFT (request sent → first
`response.output_text.delta`) per turn; the ratio is the median of the last five turns over the median of
turns 2–6 (single turns are noisy on a shared machine). Beside it, for contrast, what re-reading costs: the same
last turn sent as the whole conversation without `previous_response_id` (`store: false`), as a server without
conversation state must.

    python benchmarks/p16_conversation.py [--quick] [--out benchmarks/results/p16_conversation.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import add_compile_argument, emit  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402

TARGET = 1.2
LINES = ("But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. ",
         "Now is the winter of our discontent made glorious summer by this sun of York. ",
         "All the world's a stage, and all the men and women merely players. ",
         "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. ")


def turn_input(number: int, tokens: int, client: httpx.Client) -> str:
    """About `tokens` tokens of verse, different for every turn."""
    text, line = "", number
    while client.post("/tokenize", json={"prompt": text}).json()["count"] < tokens:
        text += LINES[line % len(LINES)]
        line += 1
    return text


def timed_turn(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """(TTFT in seconds, the final response object) of one streamed response."""
    sent, first, final = time.perf_counter(), None, None
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter()
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    assert first is not None and final is not None and final["status"] != "failed", final
    return first - sent, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--input-tokens", type=int, default=380)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8796)
    parser.add_argument("--quick", action="store_true", help="8 short turns, eager (tests)")
    parser.add_argument("--out")
    add_compile_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.turns, args.input_tokens, args.compile = 8, 60, "off"
    window = min(5, args.turns // 2 - 1)
    with tempfile.TemporaryDirectory() as store:
        server = start_server(args.model, args.port, 64, compile=args.compile,
                              env={"LINSERVE_SESSION_STORE": f"dir:{store}"})
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600)
            common = {"temperature": 0, "max_output_tokens": args.output_tokens}
            ttft, previous, conversation, tokens = [], None, [], []
            for number in range(args.turns):
                text = turn_input(number, args.input_tokens, client)
                seconds, final = timed_turn(client, {**common, "input": text, "previous_response_id": previous})
                previous = final["id"]
                ttft.append(seconds)
                tokens.append(final["usage"]["total_tokens"])
                conversation += [{"role": "user", "content": text},
                                 {"role": "assistant", "content": final["output"][0]["content"][0]["text"]}]
            reread, _ = timed_turn(client, {**common, "input": conversation[:-1], "store": False})
        finally:
            server.terminate()
            server.wait(30)
    early = statistics.median(ttft[1:1 + window])
    late = statistics.median(ttft[-window:])
    result = {"turns": args.turns, "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
              "compile": args.compile, "conversation_tokens": tokens[-1],
              "ttft_ms": [round(t * 1e3, 2) for t in ttft],
              "P16": {"early_ttft_ms": early * 1e3, "late_ttft_ms": late * 1e3, "ratio": late / early,
                      "window": window, "reread_last_turn_ttft_ms": reread * 1e3,
                      "reread_over_continued": reread / ttft[-1],
                      "target": f"late / early <= {TARGET}", "pass": late / early <= TARGET}}
    emit(result, args.out)


if __name__ == "__main__":
    main()
