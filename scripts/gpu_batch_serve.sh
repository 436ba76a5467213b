#!/usr/bin/env bash
# The batching rows of docs/remote.md: N clients against `serve --device cuda` on the real
# Qwen2.5-Coder-0.5B GGUF, one session per forward and then `--batch` (every forward serves all
# sessions with work), from other CPU cores of the same machine. Thin clients (server-stream, no
# drafting) by default; DRAFTING=on|both adds devices that stream drafts from DRAFTER on the native
# backend, one CPU thread each (OMP_NUM_THREADS=1: the clients are threads of one process).
#   MODELS=folder with qwen.gguf   OUT=where logs and results go
#   DEVICE=cuda|cpu (cpu: a dry run)   CLIENTS=1,2,4,8   N=2   TOKENS=64   MODES="one batch"
#   DRAFTING=off|on|both   DRAFTER=builtin:smollm2-135m (with DRAFTING on or both)
#   BENCH=1: then one client's `bench --modes server-stream,stream` (what the device drafted, and at what cost)
set -uo pipefail
MODELS=${MODELS:?} OUT=${OUT:?} DEVICE=${DEVICE:-cuda} CLIENTS=${CLIENTS:-1,2,4,8} N=${N:-2} TOKENS=${TOKENS:-64}
PORT=${PORT:-50581} SERVER_CORES=${SERVER_CORES:-0-7} CLIENT_CORES=${CLIENT_CORES:-8-15} MODES=${MODES:-"one batch"}
DRAFTING=${DRAFTING:-off} DRAFTER=${DRAFTER:-builtin:smollm2-135m}
export OMNIDRAFT_HOME=${OMNIDRAFT_HOME:-/tmp/omnidraft-home} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
drafter=(--drafter none)
[ "$DRAFTING" != off ] && drafter=(--drafter "$DRAFTER" --drafter-backend native)
for mode in $MODES; do
    flags=()
    [ "$mode" = batch ] && flags=(--batch)
    taskset -c "$SERVER_CORES" python3 -m omnidraft serve --target "$MODELS/qwen.gguf" --device "$DEVICE" --engine torch \
        --port "$PORT" --max-sessions 8 "${flags[@]}" >"$OUT/serve-$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        grep -q "serving " "$OUT/serve-$mode.log" && break
        kill -0 $server 2>/dev/null || { echo "serve ($mode) died:"; cat "$OUT/serve-$mode.log"; exit 1; }
        sleep 0.5
    done
    echo "== $mode"
    OMP_NUM_THREADS=1 taskset -c "$CLIENT_CORES" python3 -m omnidraft experiment capacity --target "grpc://127.0.0.1:$PORT" \
        "${drafter[@]}" --drafting "$DRAFTING" --prompts humaneval --n "$N" --max-new-tokens "$TOKENS" \
        --clients "$CLIENTS" --out "$OUT/capacity-$mode" 2>"$OUT/capacity-$mode.log" | tail -8
    if [ "${BENCH:-0}" = 1 ] && [ "$DRAFTING" != off ]; then
        OMP_NUM_THREADS=1 taskset -c "$CLIENT_CORES" python3 -m omnidraft bench --target "grpc://127.0.0.1:$PORT" \
            --drafter "$DRAFTER" --drafter-backend native --modes server-stream,stream --prompts humaneval --n "$N" \
            --max-new-tokens "$TOKENS" --out "$OUT/bench-$mode" 2>"$OUT/bench-$mode.log" | grep -E "^\| (mode|server-stream|stream) "
    fi
    kill $server; wait $server 2>/dev/null
done
