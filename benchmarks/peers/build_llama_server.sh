#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU only) from the llama-cpp-python sdist (pip download), once,
# into data/peers/llama.cpp/ (never run by the tests). Also keeps the sdist's convert_hf_to_gguf.py and gguf-py.
#   bash benchmarks/peers/build_llama_server.sh        (~15 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=0.3.36
DEST=data/peers/llama.cpp
if [ -x "$DEST/bin/llama-server" ]; then echo "$DEST/bin/llama-server (cached)"; exit 0; fi
mkdir -p data/peers/src
# the sdist itself, from wherever pip is configured to look (--no-binary: the source, never a wheel)
[ -f "data/peers/src/llama_cpp_python-$VERSION.tar.gz" ] || \
  python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d data/peers/src
tar -xzf "data/peers/src/llama_cpp_python-$VERSION.tar.gz" -C data/peers/src
SRC="data/peers/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
# CPU only: hide any CUDA compiler from CMake
PATH=$(echo "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd:) \
cmake -S "$SRC" -B data/peers/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
cmake --build data/peers/build --target llama-server -j "$(nproc)"
mkdir -p "$DEST/bin"
cp data/peers/build/bin/llama-server "$DEST/bin/"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$DEST/"
echo "$DEST/bin/llama-server"
