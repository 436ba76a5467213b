#!/bin/bash
# A/B: old (62e7878) vs new (history 8-grams), torch and llama.cpp, HumanEval 0-3, first and repeated requests
O=/work/s7/out/ab3; mkdir -p $O; PY=/work/main/.venv/bin/python
for eng in torch llamacpp; do
for arm in old new; do
H=$(/work/rows/freshhome.sh /work/s7/h-ab3-$eng-$arm)
if [ $arm = old ]; then PP=/work/s7/old; else PP=/work/main; fi
if [ $eng = torch ]; then M=target,greedy,greedy-repeat; else M=target@llamacpp,greedy@llamacpp,greedy-repeat@llamacpp; fi
(cd $H && PYTHONPATH=$PP OMNIDRAFT_HOME=$H $PY -m omnidraft bench --target builtin:qwen2.5-coder-0.5b --prompts humaneval --n 4 --max-new-tokens 128 --modes $M --out $O/$eng-$arm > $O/$eng-$arm.log 2>&1); echo "$eng $arm rc=$? $(date +%T)"
done; done
