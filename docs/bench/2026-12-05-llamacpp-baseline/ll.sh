#!/bin/bash
O=/work/s7/out; mkdir -p $O; PY=/work/main/.venv/bin/python
for set in humaneval alpaca xsum; do
H=$(/work/rows/freshhome.sh /work/s7/h-$set)
(cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft bench --target builtin:qwen2.5-coder-0.5b --prompts $set --n 4 --max-new-tokens 128 --modes llamacpp,target@llamacpp,greedy@llamacpp --out $O/$set > $O/$set.log 2>&1); echo "$set rc=$? $(date +%T)"
done
