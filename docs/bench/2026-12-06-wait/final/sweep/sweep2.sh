#!/bin/bash
# the RTTs ab2.sh did not cover, with the final code: server core 0, device core 1
O=/work/s16/sweep2; mkdir -p $O; PY=/work/main/.venv/bin/python; H=/work/s16/home15; C=/work/s16/client-ab2
lscpu | grep "Model name"
serve() { # name target engine port
  (cd /work/main && OMNIDRAFT_HOME=$H taskset -c 0 $PY -m omnidraft serve --target $2 --engine $3 --port $4 > $O/serve_$1.log 2>&1 &)
  for i in $(seq 600); do (echo > /dev/tcp/127.0.0.1/$4) 2>/dev/null && return 0; sleep 1; done; echo "server $1 never listened"; exit 1
}
bench() { # tag port rtt prompts tokens
  (cd /work/main && OMNIDRAFT_HOME=$C taskset -c 1 $PY -m omnidraft bench --target grpc://127.0.0.1:$2 --prompts $4 --n 4 \
     --max-new-tokens $5 --modes server-stream,stream --rtt-ms $3 --out $O/$1 > $O/$1.log 2>&1)
  echo "$1 rc=$? $(date +%T) $(grep -E '^\| stream ' $O/$1/results.md | cut -d'|' -f3-4,7) $(grep -ho 'stream` [0-9.]* s' $O/$1/results.md)"
}
serve q15 builtin:qwen2.5-coder-1.5b torch 50631
for rtt in 20 100; do bench q15-he-rtt$rtt 50631 $rtt humaneval 48; done
bench q15-alpaca-rtt50 50631 50 alpaca 48
pkill -f "serve --target builtin:qwen2.5-coder-1.5b"; sleep 3
serve q05 builtin:qwen2.5-coder-0.5b torch 50632
bench q05-he-rtt50 50632 50 humaneval 48
pkill -f "serve --target builtin:qwen2.5-coder-0.5b"; sleep 3
serve q05l builtin:qwen2.5-coder-0.5b llamacpp 50633
bench q05l-he-rtt50 50633 50 humaneval 48
pkill -f "serve --target builtin:qwen2.5-coder-0.5b"
echo ALLDONE
