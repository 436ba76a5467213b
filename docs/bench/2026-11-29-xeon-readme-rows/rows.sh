#!/bin/bash
# README table rows, one bench run each, fresh home per row
set -x
O=/tmp/rt2; mkdir -p $O
PY=/work/main/.venv/bin/python
row() { name=$1; shift; H=$(/tmp/freshhome.sh /tmp/rt2h-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --drafter-backend native --max-new-tokens 128 --out $O/$name > $O/$name.log 2>&1); }
LL=target,hf-uag,greedy,target@llamacpp,greedy@llamacpp
row qwen-he --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --modes $LL
row qwen-alpaca --target builtin:qwen2.5-coder-0.5b --prompts alpaca --n 4 --modes $LL
row gemma-he --target builtin:gemma3-270m --prompts humaneval --n 4 --modes $LL
row qwen15-he --target builtin:qwen2.5-coder-1.5b --engine torch --adapter none --prompts humaneval --n 4 --modes target,hf-uag,greedy
H=$(/tmp/freshhome.sh /tmp/rt2h-codeedit); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench --target builtin:qwen2.5-coder-0.5b --prompts codeedit --n 3 --max-new-tokens 96 --drafter-backend native --modes target,hf-lookup,greedy,target@llamacpp,greedy@llamacpp --out $O/codeedit > $O/codeedit.log 2>&1)
echo ALLDONE
