#!/usr/bin/env bash
# llama.cpp's own tools (llama-server, llama-quantize, llama-bench), the reference of the
# memory and speed studies, built once from the llama.cpp sources that llama-cpp-python's
# sdist vendors (PyPI only; ~11 min on 2 cores). Prints the folder holding them, which is
# where qfserve.testing.llama_tool looks by default ($QFSERVE_LLAMA_TOOLS overrides it).
# Usage: bench/reference/llama_cpp_tools.sh [DEST]   (default DEST: ~/.cache/llama-cpp-tools)
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
dest=${1:-$HOME/.cache/llama-cpp-tools}
bin=$dest/build/bin
if [ ! -x "$bin/llama-server" ] || [ ! -x "$bin/llama-quantize" ]; then
  mkdir -p "$dest/sdist"
  # --no-binary for the package only: its build tools (CMake...) may come as wheels.
  ls "$dest"/sdist/*.tar.gz >/dev/null 2>&1 ||
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$version" -d "$dest/sdist" >&2
  if [ ! -d "$dest/src" ]; then
    tar xzf "$dest"/sdist/*.tar.gz -C "$dest" --wildcards '*/vendor/llama.cpp/*'
    mv "$dest"/llama_cpp_python-*/vendor/llama.cpp "$dest/src"
  fi
  cmake -S "$dest/src" -B "$dest/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release >&2
  cmake --build "$dest/build" -j"$(nproc)" --target llama-server llama-quantize llama-bench >&2
fi
echo "$bin"
