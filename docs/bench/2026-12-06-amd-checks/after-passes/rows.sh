#!/bin/bash
# Two README rows again after the prompt-read passes (fresh home each), to compare with ../../2026-12-06-amd-rows
O=docs/bench/2026-12-06-amd-checks/after-passes; PY=.venv/bin/python
FRESH=docs/bench/2026-12-06-amd-rows/freshhome.sh
row() { name=$1; shift; H=$($FRESH /work/s15/p-$name); OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --out $O/$name > $O/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; }
row codeedit --target builtin:qwen2.5-coder-0.5b --prompts codeedit --n 3 --max-new-tokens 96 --modes target,greedy
row qwen-alpaca --target builtin:qwen2.5-coder-0.5b --prompts alpaca --n 4 --max-new-tokens 128 --modes target,greedy
echo ALLDONE
# run afterwards, alone:
# row qwen-he --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes target,greedy
