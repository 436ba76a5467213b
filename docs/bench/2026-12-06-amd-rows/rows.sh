#!/bin/bash
# README rows on this host with the current code: one bench run each, a fresh home per row (models linked)
O=${O:-docs/bench/2026-12-06-amd-rows}; PY=.venv/bin/python; mkdir -p $O
FRESH=${FRESH:-docs/bench/2026-12-06-amd-rows/freshhome.sh}
row() { name=$1; shift; H=$($FRESH /work/s15/h-$name); OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --out $O/$name > $O/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; }
LL=target,hf-uag,greedy,target@llamacpp,greedy@llamacpp
row qwen-he --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes $LL
row qwen-alpaca --target builtin:qwen2.5-coder-0.5b --prompts alpaca --n 4 --max-new-tokens 128 --modes $LL
row gemma-he --target builtin:gemma3-270m --prompts humaneval --n 4 --max-new-tokens 128 --modes $LL
row codeedit --target builtin:qwen2.5-coder-0.5b --prompts codeedit --n 3 --max-new-tokens 96 --modes target,hf-lookup,greedy,target@llamacpp,greedy@llamacpp
row qwen15-he --target builtin:qwen2.5-coder-1.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes target,greedy,target@llamacpp,greedy@llamacpp
echo ALLDONE
