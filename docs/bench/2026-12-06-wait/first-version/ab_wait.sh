#!/bin/bash
# A/B: streaming verification with the server's wait (main) vs without (/work/old), 1.5B torch, RTT 50
# server pinned to core 0, device to core 1; the two servers alternate on the same home
O=${O:-/work/s16/ab}; mkdir -p $O; PY=/work/main/.venv/bin/python
H=/work/s16/home15; [ -d $H ] || SRC=/work/s15/src bash /work/main/docs/bench/2026-12-06-amd-rows/freshhome.sh $H >/dev/null
start() { # dir port
  (cd $1 && OMNIDRAFT_HOME=$H taskset -c 0 $PY -m omnidraft serve --target builtin:qwen2.5-coder-1.5b --engine torch --port $2 > $O/serve_$2.log 2>&1 &)
  for i in $(seq 600); do (echo > /dev/tcp/127.0.0.1/$2) 2>/dev/null && return 0; sleep 1; done; echo "server $2 never listened"; exit 1
}
start /work/old 50601; echo "old up $(date +%T)"
start /work/main 50602; echo "new up $(date +%T)"
RTT=${RTT:-50}; N=${N:-4}; T=${T:-48}
for run in ${RUNS:-1 2}; do
  for arm in old new; do
    port=$([ $arm = old ] && echo 50601 || echo 50602)
    C=/work/s16/client-$arm; [ -d $C ] || SRC=/work/s15/src bash /work/main/docs/bench/2026-12-06-amd-rows/freshhome.sh $C >/dev/null
    (cd /work/main && OMNIDRAFT_HOME=$C taskset -c 1 $PY -m omnidraft bench --target grpc://127.0.0.1:$port --prompts humaneval \
       --n $N --max-new-tokens $T --modes server-stream,stream --rtt-ms $RTT --out $O/${arm}_rtt${RTT}_run$run > $O/${arm}_rtt${RTT}_run$run.log 2>&1)
    echo "$arm run$run rc=$? $(date +%T)"; grep -E "^\| (server-stream|stream) " $O/${arm}_rtt${RTT}_run$run/results.md | cut -d'|' -f2-7,16
  done
done
pkill -f "omnidraft serve --target builtin:qwen2.5-coder-1.5b"
echo ALLDONE
