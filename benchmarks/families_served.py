"""fla's families served at fla's 340M and 1.3B shapes (issue 48; on a GPU, where the state pool holds
thousands of sessions): `linserve bench`'s load at 1, 32 and 128 streams against `linserve serve --model DIR`,
the state bytes per session from /v1/models and how many sessions the accelerator's free memory holds.

    python benchmarks/families_served.py [--device cuda] [--families linear_attn gla retnet]
        [--shapes 340M 1.3B] [--streams 1 32 128] [--tokens 128] [--compile off] [--quick] [--out FILE]

Checkpoints are random-weight, fla-style initialised (benchmarks/p17_families.py's `make_checkpoint`, cached
under data/p17/). No targets: these are the figures issue 48 asks for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import torch  # noqa: E402
from common import add_compile_argument, add_device_argument, emit, resolve_device  # noqa: E402
from p17_families import FAMILIES, SHAPES, make_checkpoint  # noqa: E402
from served_load import measure  # noqa: E402
from serving_overhead import start_server  # noqa: E402


def served(directory: Path, device: str, streams: list[int], tokens: int, compile_mode: str, port: int) -> dict:
    """One checkpoint served: its card, then one load per stream count (after a short warm-up)."""
    server = start_server(str(directory), port, max(64, max(streams)), env={"LINSERVE_SESSION_STORE": "none"},
                          device=device, compile=compile_mode)
    try:
        base = f"http://127.0.0.1:{port}"
        card = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
        version = httpx.get(f"{base}/version", timeout=10).json()
        measure(port, 1, 8)
        loads = {f"streams_{n}": measure(port, n, tokens) for n in streams}
    finally:
        server.terminate()
        server.wait(60)
    return {"model_type": card.get("model_type"), "state_bytes": card.get("state_bytes"),
            "dtype": version.get("dtype"), "decode_step": version.get("decode_step"), "loads": loads}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--shapes", nargs="+", default=["340M", "1.3B"], choices=list(SHAPES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8772)
    parser.add_argument("--quick", action="store_true", help="the 2-layer shape, 8 tokens, eager (tests)")
    parser.add_argument("--out")
    add_device_argument(parser)
    add_compile_argument(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.quick:
        args.shapes, args.tokens, args.compile = ["quick"], 8, "off"
    free_bytes = torch.cuda.mem_get_info()[0] if device.type == "cuda" else None
    results = {}
    for shape in args.shapes:
        for name in args.families:
            entry = served(make_checkpoint(name, shape), device.type, args.streams, args.tokens, args.compile,
                           args.port)
            if free_bytes and entry["state_bytes"]:
                entry["sessions_in_free_memory"] = free_bytes // entry["state_bytes"]
            results[f"{name}-{shape}"] = entry
            print(name, shape, {k: round(v["tokens_per_s"]) for k, v in entry["loads"].items()}, flush=True)
    emit({"device": device.type, "accelerator_free_bytes": free_bytes, "tokens_per_stream": args.tokens,
          "compile": args.compile, "models": results}, args.out)


if __name__ == "__main__":
    main()
