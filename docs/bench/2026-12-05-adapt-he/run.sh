set -e
cd /work/s9/adapt
export OMNIDRAFT_HOME=/work/s9/adapt/home
OD=/work/main/.venv/bin/omnidraft
lscpu | grep 'Model name'
time $OD adapt --engine torch --target builtin:qwen2.5-coder-0.5b --stream humaneval --n 64 --max-new-tokens 128 --json > adapt.json
time $OD bench --engine torch --target builtin:qwen2.5-coder-0.5b --prompts humaneval --offset 100 --n 8 --max-new-tokens 128 \
   --modes target,greedy,greedy-adapter,greedy-base --out bench
