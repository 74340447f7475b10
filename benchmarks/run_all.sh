#!/usr/bin/env bash
# Runs every SPEC §7 benchmark in full, one after another, writing benchmarks/results/*.json (+ PNGs).
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
python benchmarks/decode_vs_context.py --out "$out/p1_p6_decode.json" --plot "$out/p1_decode_vs_context.png"
python benchmarks/engine_inprocess.py --out "$out/p3_p4_p7_engine.json"
python benchmarks/serving_overhead.py --out "$out/p5_serving_overhead.json"
python benchmarks/served_flatness.py --out-dir "$out"
python benchmarks/memory.py --out "$out/p8_memory.json"
