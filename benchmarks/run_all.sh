#!/usr/bin/env bash
# Runs every SPEC §7 benchmark in full, one after another, writing benchmarks/results/*.json (+ PNGs).
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
python benchmarks/decode_vs_context.py --out "$out/p1_p6_decode.json" --plot "$out/p1_decode_vs_context.png"
python benchmarks/engine_inprocess.py --out "$out/p3_p4_p7_engine.json"
python benchmarks/serving_overhead.py --out "$out/p5_serving_overhead.json"
python benchmarks/compile_vs_eager.py --out "$out/compile_vs_eager.json"
python benchmarks/served_flatness.py --out-dir "$out"
python benchmarks/memory.py --out "$out/p8_memory.json"
python benchmarks/p10_resume.py --reps 21 --out "$out/p10_resume.json"
python benchmarks/p13_store_outage.py --seconds 15 --out "$out/p13_store_outage.json"
python benchmarks/session_affinity.py --out "$out/session_affinity.json"
python benchmarks/p14_constrained.py --out "$out/p14_constrained.json"
python benchmarks/p16_conversation.py --out "$out/p16_conversation.json"
python benchmarks/priority_ttft.py --out "$out/priority_ttft.json"
python benchmarks/grammar_engines.py --out "$out/grammar_engines.json"
python benchmarks/cli_startup.py --out "$out/cli_startup.json"
python benchmarks/p12_first_start.py --stream-s 30 --out "$out/p12_first_start.json"
# P9 needs the llama.cpp peer, built once (~15 min): bash benchmarks/peers/build_llama_server.sh && python benchmarks/peers/make_models.py
if [ -x data/peers/llama.cpp/bin/llama-server ] && [ -f data/peers/models/mamba.gguf ]; then
  python benchmarks/p9_peers.py --out "$out/p9_peers.json" --plot "$out/p9_peers.png"
else
  echo "P9 skipped: build the llama.cpp peer first (see above)"
fi
