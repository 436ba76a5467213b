#!/bin/bash
# the weights choice, measured: one fresh home, adapt ja 100 then toolcall 48 (as the forgetting runs),
# then each held-out set with the choice (greedy), the adapter always (greedy-adapter) and the base weights (greedy-base)
O=/tmp/wc/out; mkdir -p $O; PY=/work/main/.venv/bin/python
H=$H; mkdir -p $H; cd $H
T="--engine torch --target builtin:qwen2.5-coder-0.5b --drafter-backend native"
run() { name=$1; shift; OMNIDRAFT_HOME=$H $PY -m omnidraft "$@" > $O/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; }
echo "start $(date +%T)"; lscpu | grep "Model name"
run adapt-ja adapt $T --stream ja --n 100 --max-new-tokens 64 --json
run adapt-toolcall adapt $T --stream toolcall --n 48 --max-new-tokens 128 --json
M=target,greedy,greedy-adapter,greedy-base
run bench-he bench $T --prompts humaneval --offset 100 --n 8 --max-new-tokens 128 --modes $M --out $O/he
run bench-alpaca bench $T --prompts alpaca --offset 200 --n 8 --max-new-tokens 128 --modes $M --out $O/alpaca
run bench-ja bench $T --prompts ja --offset 100 --n 16 --max-new-tokens 64 --modes $M --out $O/ja
echo ALLDONE
