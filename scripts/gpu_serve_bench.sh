#!/usr/bin/env bash
# The GPU rows of docs/remote.md: `serve --device cuda` on the real Qwen2.5-Coder-0.5B GGUF, and
# `bench` against it from two CPU cores of the same machine (the device, drafting SmolLM2-135M
# with the torch backend: a GPU machine has no llama.cpp build of ours).
#   MODELS=folder with qwen.gguf and smol.gguf   OUT=where logs and results go
#   DEVICE=cuda|cpu (cpu: a dry run of this script)   RTTS="0 50"   N=3   TOKENS=64
set -uo pipefail
MODELS=${MODELS:?} OUT=${OUT:?} DEVICE=${DEVICE:-cuda} RTTS=${RTTS:-"0 50"} N=${N:-3} TOKENS=${TOKENS:-64}
PORT=${PORT:-50571} SERVER_CORES=${SERVER_CORES:-0-7} CLIENT_CORES=${CLIENT_CORES:-8,9}
export OMNIDRAFT_HOME=${OMNIDRAFT_HOME:-/tmp/omnidraft-home} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
taskset -c "$SERVER_CORES" python3 -m omnidraft serve --target "$MODELS/qwen.gguf" --device "$DEVICE" --engine torch \
    --port "$PORT" >"$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 600); do
    grep -q "serving " "$OUT/serve.log" && break
    kill -0 $server 2>/dev/null || { echo "serve died:"; cat "$OUT/serve.log"; exit 1; }
    sleep 0.5
done
grep -v -e Converting -e "Loading weights" "$OUT/serve.log"
for rtt in $RTTS; do
    echo "== RTT $rtt ms"
    OMP_NUM_THREADS=2 taskset -c "$CLIENT_CORES" python3 -m omnidraft bench --target "grpc://127.0.0.1:$PORT" \
        --drafter "$MODELS/smol.gguf" --drafter-backend torch --drafter-dtype bfloat16 --prompts humaneval \
        --n "$N" --max-new-tokens "$TOKENS" --modes server-stream,stream --rtt-ms "$rtt" \
        --out "$OUT/bench-rtt$rtt" 2>"$OUT/bench-rtt$rtt.log" | tail -20
done
