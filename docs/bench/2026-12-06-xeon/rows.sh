set -e
cd /work/s10
export OMNIDRAFT_HOME=/work/s10/fresh/home
OD=/work/main/.venv/bin/omnidraft
lscpu | grep 'Model name'
for p in humaneval alpaca; do
  $OD bench --engine torch --target builtin:qwen2.5-coder-0.5b --prompts $p --n 4 --max-new-tokens 128 --modes target,greedy --out fresh/$p
done
