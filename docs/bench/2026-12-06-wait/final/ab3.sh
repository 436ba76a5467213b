#!/bin/bash
# A/B: the server's wait (main) against the code before it (/work/old at ab40916), alternating; server core 0, device core 1
O=/work/s16/ab3; mkdir -p $O; PY=/work/main/.venv/bin/python; H=/work/s16/home15
lscpu | grep "Model name"
serve() { # dir port target engine
  (cd $1 && OMNIDRAFT_HOME=$H taskset -c 0 $PY -m omnidraft serve --target $3 --engine $4 --port $2 > $O/serve_$2.log 2>&1 &)
  for i in $(seq 600); do (echo > /dev/tcp/127.0.0.1/$2) 2>/dev/null && return 0; sleep 1; done; echo "server $2 never listened"; exit 1
}
bench() { # tag port rtt tokens
  C=/work/s16/client-ab3; [ -d $C ] || SRC=/work/s15/src bash /work/main/docs/bench/2026-12-06-amd-rows/freshhome.sh $C >/dev/null
  (cd /work/main && OMNIDRAFT_HOME=$C taskset -c 1 $PY -m omnidraft bench --target grpc://127.0.0.1:$2 --prompts humaneval --n 4 \
     --max-new-tokens $4 --modes server-stream,stream --rtt-ms $3 --out $O/$1 > $O/$1.log 2>&1)
  echo "$1 rc=$? $(date +%T) $(grep -E '^\| stream ' $O/$1/results.md | cut -d'|' -f3-4,7) $(grep -ho 'stream` [0-9.]* s' $O/$1/results.md)"
}
serve /work/old 50623 builtin:qwen2.5-coder-1.5b torch; serve /work/main 50624 builtin:qwen2.5-coder-1.5b torch
bench q15-rtt50-new 50624 50 48; bench q15-rtt50-old 50623 50 48
bench q15-rtt0-old 50623 0 48; bench q15-rtt0-new 50624 0 48
bench q15-rtt50-t128-new 50624 50 128; bench q15-rtt50-t128-old 50623 50 128
pkill -f "serve --target builtin:qwen2.5-coder-1.5b"
echo ALLDONE
