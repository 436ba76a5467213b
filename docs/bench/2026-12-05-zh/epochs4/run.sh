#!/bin/bash
# recipe variant: 4 passes over each update's records (--epochs 4), otherwise as run.sh; then the same held-out benches
O=/work/s8/zh/out-e4; mkdir -p $O; PY=/work/main/.venv/bin/python
H=/work/s8/zh/home-e4; /work/rows/freshhome.sh $H >/dev/null
T="--engine torch --target builtin:qwen2.5-coder-0.5b"
run() { name=$1; shift; (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
echo "start $(date +%T)"; lscpu | grep "Model name"
run adapt-zh adapt $T --stream zh --n 100 --max-new-tokens 96 --epochs 4 --json
run bench-zh-k4 bench $T --prompts zh --offset 100 --n 16 --max-new-tokens 96 --modes target,greedy-adapter,greedy-base --draft-stop fixed --draft-len 4 --no-lookup --out $O/zh-k4
echo ALLDONE
