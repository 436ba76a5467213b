#!/bin/bash
O=/tmp/rows3; PY=/work/main/.venv/bin/python
row() { name=$1; shift; H=$(/tmp/freshhome.sh /tmp/rows3h-$name); (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench "$@" --out $O/$name > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
row codeedit --target builtin:qwen2.5-coder-0.5b --prompts codeedit --n 3 --max-new-tokens 96 --modes target,hf-lookup,greedy,target@llamacpp,greedy@llamacpp
echo ALLDONE
