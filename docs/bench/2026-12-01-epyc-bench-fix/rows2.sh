#!/bin/bash
O=/tmp/rows; mkdir -p $O
PY=/work/main/.venv/bin/python
row() { name=$1; shift; H=$(/tmp/freshhome.sh /tmp/rowsh-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --out $O/$name > $O/$name.log 2>&1); echo "$name rc=$?"; }
LL=target,hf-uag,greedy,target@llamacpp,greedy@llamacpp
row gemma-he --target builtin:gemma3-270m --prompts humaneval --n 4 --max-new-tokens 128 --modes $LL
row qwen-xsum-ll --target builtin:qwen2.5-coder-0.5b --engine llamacpp --prompts xsum --n 4 --max-new-tokens 128 --modes target,greedy
row codeedit --target builtin:qwen2.5-coder-0.5b --prompts codeedit --n 3 --max-new-tokens 96 --modes target,hf-lookup,greedy,target@llamacpp,greedy@llamacpp
echo ALLDONE
