#!/usr/bin/env bash
# The GPU suite in one command: the test suite on CUDA, P1, P5, P6, a served load at 1/32/128 streams and
# the CPU thread sweep, into benchmarks/results/gpu/gpu_suite.json and gpu_rows.md (docs/benchmarks.md's
# GPU table), the machine named. Without CUDA it says so, runs the CPU-only parts and exits 0.
#   bash benchmarks/gpu.sh [--parts tests,fla,p1p6,p5,served,p12,p15,families,threads] [--quick] [--out-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PYTHON" benchmarks/gpu_suite.py "$@"
