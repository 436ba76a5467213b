#!/bin/bash
# after adapt: held-out zh 100-115 (96 tokens), the default policy (speed) and a fixed draft of 4 with lookup off (acceptance)
O=/work/s8/zh/out; PY=/work/main/.venv/bin/python; H=/work/s8/zh/home
while pgrep -f "omnidraft adapt" >/dev/null; do sleep 10; done
T="--engine torch --target builtin:qwen2.5-coder-0.5b"
run() { name=$1; shift; (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
echo "bench start $(date +%T)"; lscpu | grep "Model name"
run bench-zh bench $T --prompts zh --offset 100 --n 16 --max-new-tokens 96 --modes target,greedy,greedy-adapter,greedy-base --out $O/zh
run bench-zh-k4 bench $T --prompts zh --offset 100 --n 16 --max-new-tokens 96 --modes target,greedy-adapter,greedy-base --draft-stop fixed --draft-len 4 --no-lookup --out $O/zh-k4
echo ALLDONE
