#!/bin/bash
# forgetting and the weak domain, re-measured with the kernels timed at load: one fresh home, adapt ja 100 then toolcall 48,
# then each held-out set with the adapted drafter and its base weights side by side (greedy vs greedy-base)
O=/tmp/rows3/forget; mkdir -p $O; PY=/work/main/.venv/bin/python
H=$(/tmp/freshhome.sh /tmp/rows3h-forget); cd $H
T="--engine torch --target builtin:qwen2.5-coder-0.5b"
run() { name=$1; shift; OMNIDRAFT_HOME=$H $PY -m omnidraft "$@" > $O/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; }
run adapt-ja adapt $T --stream ja --n 100 --max-new-tokens 64 --json
run adapt-toolcall adapt $T --stream toolcall --n 48 --max-new-tokens 128 --json
run bench-ja bench $T --prompts ja --offset 100 --n 16 --max-new-tokens 64 --modes target,greedy,greedy-base --out $O/ja
run bench-he bench $T --prompts humaneval --offset 100 --n 8 --max-new-tokens 128 --modes target,greedy,greedy-base --out $O/he
run bench-alpaca bench $T --prompts alpaca --offset 200 --n 8 --max-new-tokens 128 --modes target,greedy,greedy-base --out $O/alpaca
echo ALLDONE
