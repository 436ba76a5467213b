#!/bin/bash
# chat A/B: relocation on (main) vs off (worktree), target alone baseline; English alpaca turns, small context window so trims happen
O=/tmp/chatab; mkdir -p $O
PY=/work/main/.venv/bin/python
ARGS="--engine torch --target builtin:qwen2.5-coder-0.5b --context-window 640 --max-new-tokens 96 --no-train"
run() { # name src extra
  H=$(/tmp/freshhome.sh /tmp/chath-$1)
  (cd $2 && OMNIDRAFT_HOME=$H PYTHONPATH=$2 $PY scripts/chat_session.py run --prompts alpaca --offset 100 --turns 12 --pause 1 --out $O/$1.json -- $ARGS $3 > $O/$1.log 2>&1)
  echo "$1 done rc=$?"
}
run alone /work/main "--drafter none"
run reloc /work/main ""
run noreloc /tmp/wt-noreloc ""
