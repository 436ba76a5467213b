#!/bin/bash
# issue 32 on Chinese: one fresh home, adapt zh 0-99 (96 tokens), then held-out zh 100-115 with the choice,
# the adapter always and the base weights side by side; then the same at a fixed draft of 4, lookup off (acceptance)
O=/work/s8/zh/out; mkdir -p $O; PY=/work/main/.venv/bin/python
H=/work/s8/zh/home; /work/rows/freshhome.sh $H >/dev/null
T="--engine torch --target builtin:qwen2.5-coder-0.5b"
run() { name=$1; shift; OMNIDRAFT_HOME=$H $PY -m omnidraft "$@" > $O/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; }
echo "start $(date +%T)"; lscpu | grep "Model name"
run adapt-zh adapt $T --stream zh --n 100 --max-new-tokens 96 --json
echo ADAPTED
