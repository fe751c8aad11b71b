#!/usr/bin/env bash
# llama.cpp's own tools (llama-server, llama-quantize, llama-bench) and llama-cpp-python on
# their libllama: the references of the memory, speed and parity studies, built once from the
# llama.cpp sources that llama-cpp-python's sdist vendors (PyPI only; ~11 min on 2 cores).
# Prints the folder holding the tools, which is
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
  # The CPU's own instruction sets, but never AMX: a virtual machine may list AMX in its CPU
  # flags without granting the tile state, and ggml's AMX kernels then die of SIGILL.
  isa=(-DGGML_NATIVE=ON)
  if [ "$(uname -m)" = x86_64 ]; then
    has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
    isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    has avx2 && isa+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    has avx_vnni && isa+=(-DGGML_AVX_VNNI=ON)
    has avx512f && isa+=(-DGGML_AVX512=ON)
    has avx512vbmi && isa+=(-DGGML_AVX512_VBMI=ON)
    has avx512_vnni && isa+=(-DGGML_AVX512_VNNI=ON)
    has avx512_bf16 && isa+=(-DGGML_AVX512_BF16=ON)
  fi
  cmake -S "$dest/src" -B "$dest/build" "${isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release >&2
  cmake --build "$dest/build" -j"$(nproc)" --target llama-server llama-quantize llama-bench >&2
fi
# llama-cpp-python, the reference for tokens and logits (qfserve.testing.llama_cpp_python),
# on the libllama just built: no second compile of llama.cpp.
if ! python3 -c 'import llama_cpp' 2>/dev/null; then
  CMAKE_ARGS="-DLLAMA_BUILD=OFF" python3 -m pip install -q "$dest"/sdist/*.tar.gz diskcache >&2 || true
fi
echo "$bin"
