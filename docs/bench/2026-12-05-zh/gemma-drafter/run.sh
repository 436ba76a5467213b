#!/bin/bash
# Gemma-3-270M (its GGUF on llama.cpp) as the drafter of the torch Qwen-0.5B on held-out zh: a drafter whose vocabulary spells Chinese in words
O=/work/s8/gemma/out; mkdir -p $O; PY=/work/main/.venv/bin/python
H=/work/s8/gemma/home; /work/rows/freshhome.sh $H >/dev/null
T="--engine torch --target builtin:qwen2.5-coder-0.5b --drafter builtin:gemma3-270m --drafter-backend llamacpp"
run() { name=$1; shift; (cd $H && OMNIDRAFT_HOME=$H $PY -m omnidraft "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(date +%T)"; }
echo "start $(date +%T)"; lscpu | grep "Model name"
run k4 bench $T --prompts zh --offset 100 --n 8 --max-new-tokens 96 --modes target,greedy --draft-stop fixed --draft-len 4 --no-lookup --out $O/k4
run default bench $T --prompts zh --offset 100 --n 8 --max-new-tokens 96 --modes target,greedy --out $O/default
echo ALLDONE
