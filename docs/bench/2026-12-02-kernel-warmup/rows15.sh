#!/bin/bash
O=/tmp/rows3; PY=/work/main/.venv/bin/python
row() { name=$1; shift; H=$(/tmp/freshhome.sh /tmp/rows3h-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --out $O/$name > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
row qwen15-he --target builtin:qwen2.5-coder-1.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes target,greedy,target@llamacpp,greedy@llamacpp
echo ALLDONE
