#!/bin/bash
# 0.5B goal rows with the kernel of this session: one bench run each, fresh home each
O=/tmp/goals3; mkdir -p $O
PY=/work/main/.venv/bin/python
run() {  # name target prompts extra...
  name=$1; t=$2; p=$3; shift 3
  H=$(/tmp/freshhome.sh /tmp/goals3-h-$name)
  (cd /work/main && OMNIDRAFT_HOME=$H $PY -m omnidraft bench --target $t --engine torch --prompts $p --n 4 --max-new-tokens 128 --drafter-backend native --modes target,greedy "$@" --out $O/$name > $O/$name.log 2>&1)
  echo "== $name"; grep -E "^\| (target|hf-uag|greedy) |^\| mode" $O/$name/results.md
}
run q05-humaneval builtin:qwen2.5-coder-0.5b humaneval
run q05-alpaca builtin:qwen2.5-coder-0.5b alpaca
