#!/bin/bash
# README rows with token healing: one bench run each, a fresh home per row (models linked)
O=/work/rows/out; PY=.venv/bin/python; mkdir -p $O
row() { name=$1; shift; H=$(/work/rows/freshhome.sh /work/rows/h-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --out $O/$name > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
LL=target,hf-uag,greedy,target@llamacpp,greedy@llamacpp
row qwen-he --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes $LL
row qwen-alpaca --target builtin:qwen2.5-coder-0.5b --prompts alpaca --n 4 --max-new-tokens 128 --modes $LL
row gemma-he --target builtin:gemma3-270m --prompts humaneval --n 4 --max-new-tokens 128 --modes $LL
row codeedit --target builtin:qwen2.5-coder-0.5b --prompts codeedit --n 3 --max-new-tokens 96 --modes target,hf-lookup,greedy,target@llamacpp,greedy@llamacpp
row qwen15-he --target builtin:qwen2.5-coder-1.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes target,greedy,target@llamacpp,greedy@llamacpp
echo ALLDONE
