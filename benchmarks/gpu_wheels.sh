#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, triton, transformers, httpx, prometheus-client, uvloop
# but not linserve's server stack; nothing can be installed from a registry there), for its Python 3.12, at the
# versions configs/constraints.txt pins, into DIR (default .whl, which the device call carries):
#   bash benchmarks/gpu_wheels.sh [DIR]
# There, before `bash benchmarks/gpu.sh`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PACKAGES=(fastapi starlette uvicorn pydantic pydantic_core pydantic-settings python-dotenv typing-inspection
          annotated-types opentelemetry-api redis llguidance fastapi-offline transformers httptools typing_extensions)
pins=()
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i -E "^${name//[-_]/[-_]}==" configs/constraints.txt || true)
    [ -n "$pin" ] || { echo "no pin for $name in configs/constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
           manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
mkdir -p "$DIR"
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DIR" "${pins[@]}"
ls "$DIR"
du -sh "$DIR"
