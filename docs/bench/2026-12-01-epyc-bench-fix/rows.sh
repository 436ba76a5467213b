#!/bin/bash
# issue-34 goal rows on this host, one bench run each, fresh home per row (models linked)
O=/tmp/rows; mkdir -p $O
PY=/work/main/.venv/bin/python
row() { name=$1; shift; H=$(/tmp/freshhome.sh /tmp/rowsh-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --max-new-tokens 128 --out $O/$name > $O/$name.log 2>&1); echo "$name rc=$?"; }
LL=target,hf-uag,greedy,target@llamacpp,greedy@llamacpp
row qwen-he --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --modes $LL
row qwen-alpaca --target builtin:qwen2.5-coder-0.5b --prompts alpaca --n 4 --modes $LL
row gemma-he --target builtin:gemma3-270m --prompts humaneval --n 4 --modes $LL
row qwen-xsum-ll --target builtin:qwen2.5-coder-0.5b --engine llamacpp --prompts xsum --n 4 --modes target,greedy
echo ALLDONE
