#!/bin/bash
# README torch rows after the kernel warm-up moved to load time: one bench run each, fresh home per row (models linked)
O=/tmp/rows3; PY=/work/main/.venv/bin/python
row() { name=$1; shift; H=$(/tmp/freshhome.sh /tmp/rows3h-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --max-new-tokens 128 --out $O/$name > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
LL=target,hf-uag,greedy,target@llamacpp,greedy@llamacpp
row qwen-he --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --modes $LL
row qwen-alpaca --target builtin:qwen2.5-coder-0.5b --prompts alpaca --n 4 --modes $LL
row gemma-he --target builtin:gemma3-270m --prompts humaneval --n 4 --modes $LL
echo ALLDONE
