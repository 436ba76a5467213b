#!/bin/bash
# the new code's rows for "never below 0.98x server-stream": llama.cpp targets over the RTTs, 8 prompts x 96 tokens
O=/work/s17/sweep; mkdir -p $O; PY=/work/main/.venv/bin/python; H=/work/s16/home15; C=/work/s16/client-ab2
lscpu | grep "Model name"
serve() { # name target engine port
  (cd /work/main && OMNIDRAFT_HOME=$H taskset -c 0 $PY -m omnidraft serve --target $2 --engine $3 --port $4 > $O/serve_$1.log 2>&1 &)
  for i in $(seq 600); do (echo > /dev/tcp/127.0.0.1/$4) 2>/dev/null && return 0; sleep 1; done; echo "server $1 never listened"; exit 1
}
bench() { # tag port rtt prompts n tokens
  (cd /work/main && OMNIDRAFT_HOME=$C taskset -c 1 $PY -m omnidraft bench --target grpc://127.0.0.1:$2 --prompts $4 --n $5 \
     --max-new-tokens $6 --modes server-stream,stream --rtt-ms $3 --out $O/$1 > $O/$1.log 2>&1)
  echo "$1 rc=$? $(date +%T) $(grep -E '^\| stream ' $O/$1/results.md | cut -d'|' -f3-4,6,7,8) | $(grep -o 'slows the server.s steps): .*' $O/$1/results.md)"
}
serve q05l builtin:qwen2.5-coder-0.5b llamacpp 50661
for rtt in 0 20 50 100 200; do bench q05l-he-rtt$rtt 50661 $rtt humaneval 8 96; done
bench q05l-alpaca-rtt50 50661 50 alpaca 8 96
pkill -f "port 50661"; sleep 2
serve g27l builtin:gemma3-270m llamacpp 50662
bench g27l-he-rtt50 50662 50 humaneval 8 96
pkill -f "port 50662"
echo ALLDONE
