#!/bin/bash
# A/B of the device horizon: old (6a12e72, /work/old) vs new (/work/main), alternating; server core 0, device core 1
# usage: ab.sh TAG TARGET ENGINE RTT PROMPTS ROUNDS
TAG=$1; T=$2; E=$3; RTT=$4; PR=$5; N=${6:-2}
O=/work/s17/ab/$TAG; mkdir -p $O; PY=/work/main/.venv/bin/python; H=/work/s16/home15
lscpu | grep "Model name"
serve() { # dir port
  (cd $1 && OMNIDRAFT_HOME=$H taskset -c 0 $PY -m omnidraft serve --target $T --engine $E --port $2 > $O/serve_$2.log 2>&1 &)
  for i in $(seq 600); do (echo > /dev/tcp/127.0.0.1/$2) 2>/dev/null && return 0; sleep 1; done; echo "server $2 never listened"; exit 1
}
bench() { # dir port name
  (cd $1 && OMNIDRAFT_HOME=/work/s16/client-ab2 taskset -c 1 $PY -m omnidraft bench --target grpc://127.0.0.1:$2 --prompts $PR --n ${NP:-4} \
     --max-new-tokens ${TOK:-48} --modes server-stream,stream --rtt-ms $RTT --out $O/$3 > $O/$3.log 2>&1)
  echo "$3 rc=$? $(date +%T) $(grep -E '^\| stream ' $O/$3/results.md | cut -d'|' -f3-4,7,8) | $(grep -o 'slows the server.s steps): .*' $O/$3/results.md)"
}
serve /work/old 50651; serve /work/main 50652
for i in $(seq $N); do bench /work/old 50651 old$i; bench /work/main 50652 new$i; done
pkill -f "port 50651"; pkill -f "port 50652"
echo ALLDONE
