#!/bin/bash
# A/B of the native drafter kernel: base (a3667d4) vs new (working tree), torch Qwen-0.5B, fresh home each run, interleaved
O=/tmp/abk; mkdir -p $O
PY=/work/main/.venv/bin/python
for P in humaneval alpaca; do
  for v in base new; do
    src=/work/main; [ $v = base ] && src=/tmp/wt-base
    H=$(/tmp/freshhome.sh /tmp/abk-h-$v-$P)
    (cd $src && OMNIDRAFT_HOME=$H PYTHONPATH=$src $PY -m omnidraft bench --target builtin:qwen2.5-coder-0.5b --engine torch --prompts $P --n 4 --max-new-tokens 128 --drafter-backend native --modes target,greedy --out $O/$P-$v > $O/$P-$v.log 2>&1)
    echo "== $P $v"; grep -E "^\| (target|greedy) |^\| mode" $O/$P-$v/results.md
  done
done
