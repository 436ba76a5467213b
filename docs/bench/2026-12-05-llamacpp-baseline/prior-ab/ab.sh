#!/bin/bash
# A/B of the acceptance prior: old (HEAD~1 worktree) vs new, llama.cpp Qwen-0.5B, repeated and fresh requests
O=/work/s7/out/ab; mkdir -p $O; PY=/work/main/.venv/bin/python
for arm in new old; do
H=$(/work/rows/freshhome.sh /work/s7/h-ab-$arm)
if [ $arm = old ]; then PP=/work/s7/old; else PP=/work/main; fi
(cd $H && PYTHONPATH=$PP OMNIDRAFT_HOME=$H $PY -m omnidraft bench --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes target@llamacpp,greedy@llamacpp,greedy-repeat@llamacpp --out $O/$arm > $O/$arm.log 2>&1); echo "$arm rc=$? $(date +%T)"
done
