#!/bin/bash
# drafter window A/B on held-out zh (long prompts): fixed draft of 4, lookup off, the zh-adapted home
O=/work/s8/win/out; mkdir -p $O; PY=/work/main/.venv/bin/python; H=/work/s8/zh/home
T="--engine torch --target builtin:qwen2.5-coder-0.5b"
for w in 1024 256 512; do
  (cd $H && OMNIDRAFT_HOME=$H $PY /work/s8/win/bw.py $w $T --prompts zh --offset 100 --n 8 --max-new-tokens 96 \
     --modes target,greedy-adapter,greedy-base --draft-stop fixed --draft-len 4 --no-lookup --out $O/k4-w$w > $O/k4-w$w.log 2>&1)
  echo "w$w rc=$? $(date +%T)"
done
echo ALLDONE
