#!/bin/bash
# the native drafter in the loop: base (284bd4c kernel) vs new (HEAD), interleaved, fresh home each; then Gemma
O=/tmp/goals2; mkdir -p $O
PY=/work/main/.venv/bin/python
for P in humaneval alpaca; do
  for v in base new; do
    src=/work/main; [ $v = base ] && src=/tmp/wt-base
    H=$(/tmp/freshhome.sh /tmp/goals2-h-$v-$P)
    (cd $src && OMNIDRAFT_HOME=$H PYTHONPATH=$src $PY -m omnidraft bench --target builtin:qwen2.5-coder-0.5b --engine torch --prompts $P --n 4 --max-new-tokens 128 --drafter-backend native --modes target,greedy --out $O/$P-$v > $O/$P-$v.log 2>&1)
    echo "== $P $v"; grep -E "^\| (target|greedy) |^\| mode" $O/$P-$v/results.md
  done
done
H=$(/tmp/freshhome.sh /tmp/goals2-h-gemma)
(cd /work/main && OMNIDRAFT_HOME=$H $PY -m omnidraft bench --target builtin:gemma3-270m --engine torch --prompts humaneval --n 4 --max-new-tokens 128 --drafter-backend native --modes target,hf-uag,greedy --out $O/gemma > $O/gemma.log 2>&1)
echo "== gemma"; grep -E "^\| (target|hf-uag|greedy) |^\| mode" $O/gemma/results.md
