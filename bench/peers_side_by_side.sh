#!/bin/bash
# vlmcap, vLLM-CPU and llama.cpp side by side on the engine-speed workloads (issue 11's table), one server at a
# time, the same checkpoint (dummy:smolvlm-256m, bfloat16) and the same client (`vlmcap bench ...`, ignore_eos).
#
#   PEER=$HOME/vllm-peer bench/peers_side_by_side.sh [vllm|vlmcap|both|llama]     # default: both (vLLM, vlmcap)
#   LLAMA_PEER=$HOME/llama-peer LLAMA_TYPE=q8_0 bench/peers_side_by_side.sh llama
#
# Needs vLLM-CPU built once: PEER=$HOME/vllm-peer ../shared/peers/vllm-cpu/setup.sh (see its README); for llama.cpp,
# LLAMA_PEER=$HOME/llama-peer: its setup.sh, then convert.sh of MODEL_DIR into $LLAMA_PEER/gguf (OUTTYPE=$LLAMA_TYPE,
# bf16 by default; q8_0 for its 8-bit weights). llama-server runs 32 slots of 2,048 tokens (serve.sh's NP and
# CTX_PER_SLOT), so that no workload's request waits for a slot; LLAMA_FLAGS adds llama-server flags (e.g.
# --no-repack: its repacked Q8_0 weights crash at start-up on the AMX machine). vlmcap's name in the results is $VLMCAP_NAME
# (default vlmcap; e.g. vlmcap-int8 with SETTINGS="--quantization int8").
# Writes JSON, PNG and text per workload and server to $OUT (default bench/results/side-by-side) and prints a
# summary. Workloads:
#   chats8   8 streaming chats, 256 tokens each: gap between tokens (ITL p50)
#   stall    the same 8 chats while a 2-photo prompt is prefilled: worst gap, the image prompt's TTFT,
#            chat tokens/s in that window
#   text32   32 text requests at once, 64 tokens each: output tokens/s (vlmcap with budget 2048)
#   mixed24  24 requests at 1/s, a quarter with a photo, 64 tokens each: TTFT p50, end-to-end p50
#   with VBENCH=1 (VBENCH_ONLY=1: only this), also vLLM's own client (`vllm bench serve`, random-mm: 16 requests with a fresh 256 px photo
#   each, 8 at a time), its table in $OUT/<server>-vbench-random-mm.txt
# Each server first answers a warm-up (4 requests, half with a photo; 8 at once; 32 at once), not measured.
# Settings: vlmcap on its defaults (steps budgeted by its inter-token-latency target; SETTINGS adds flags, e.g.
# SETTINGS="--itl-target-ms 0" for token budgets only); vLLM --max-num-batched-tokens 256 (serve.sh's), 2 OpenMP
# threads on cores 0-1.
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:-both}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/side-by-side}
PORT=${PORT:-8799}
THREADS=${THREADS:-2}
SETTINGS=${SETTINGS:-}
VLMCAP_NAME=${VLMCAP_NAME:-vlmcap}
LLAMA_TYPE=${LLAMA_TYPE:-bf16}
PEERS_DIR=${PEERS_DIR:-$(cd .. && pwd)/shared/peers/vllm-cpu}
URL=http://127.0.0.1:$PORT
MODEL_DIR=${MODEL_DIR:-$($PY -c "from engine.models import resolve_checkpoint as r; print(r('dummy:smolvlm-256m'))" \
  2>/dev/null | tail -1)}
mkdir -p "$OUT"
SERVER_PID=

stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT

wait_ready() {  # $1: health path
  for _ in $(seq 1 900); do
    if curl -sf -o /dev/null "$URL$1"; then return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited; see $OUT/*.log" >&2; return 1; }
    sleep 1
  done
  echo "the server was not ready in 15 minutes" >&2
  return 1
}

start_vllm() {
  : "${PEER:?set PEER to the folder that the vLLM-CPU setup.sh filled}"
  # A step that compiles a new shape on a busy machine can pass vLLM's 300 s default, and the engine dies
  # ("RPC call to execute_model timed out", seen here under a load of 10 on 2 cores).
  VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=${VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS:-3600} PEER=$PEER \
    "$PEERS_DIR/serve.sh" "$MODEL_DIR" "$PORT" > "$OUT/vllm-server.log" 2>&1 &
  SERVER_PID=$!
  wait_ready /health
  warm_up vllm
}

start_llama() {
  : "${LLAMA_PEER:?set LLAMA_PEER to the folder that the llama.cpp setup.sh filled}"
  local gguf=$LLAMA_PEER/gguf
  [ -f "$gguf/text-$LLAMA_TYPE.gguf" ] || { echo "no $gguf/text-$LLAMA_TYPE.gguf: run convert.sh" >&2; return 1; }
  NP=${NP:-32} CTX_PER_SLOT=${CTX_PER_SLOT:-2048} THREADS=$THREADS PEER=$LLAMA_PEER \
    "$(dirname "$PEERS_DIR")/llama-cpp/serve.sh" "$gguf/text-$LLAMA_TYPE.gguf" "$gguf/mmproj-$LLAMA_TYPE.gguf" "$PORT" \
    ${LLAMA_FLAGS:-} > "$OUT/llama-$LLAMA_TYPE-server.log" 2>&1 &
  SERVER_PID=$!
  wait_ready /health
  warm_up llama
}

start_vlmcap() {  # on its defaults, plus $SETTINGS
  # shellcheck disable=SC2086
  $PY -c "from cli.main import app; app(prog_name='vlmcap')" serve --model dummy:smolvlm-256m --dtype bfloat16 \
    --port "$PORT" --no-queue --num-threads "$THREADS" $SETTINGS --log-level warning \
    > "$OUT/vlmcap-server.log" 2>&1 &
  SERVER_PID=$!
  wait_ready /ready
  warm_up "$VLMCAP_NAME"
}

warm_up() {  # $1: a name for its log. Not measured: requests with an image, then batches of 8 and of 32
  # (the workloads' shapes: vLLM compiles a shape on its first use, for minutes on these 2 cores)
  $PY -m bench serve --url "$URL" --rate inf --num-requests 4 --image-fraction 0.5 --max-tokens 8 --seed 3 \
    > "$OUT/warm-up-$1.txt" 2>&1
  $PY -m bench serve --url "$URL" --rate inf --num-requests 8 --image-fraction 0 --max-tokens 32 --seed 4 \
    >> "$OUT/warm-up-$1.txt" 2>&1
  $PY -m bench serve --url "$URL" --rate inf --num-requests 32 --image-fraction 0 --max-tokens 16 --seed 5 \
    >> "$OUT/warm-up-$1.txt" 2>&1
}

vbench() {  # $1: server name, $2: the model id it serves. vLLM's own client (`vllm bench serve`), 16 requests with one fresh 256 px photo each
  # (17 SmolVLM tiles), 8 at a time: its table (TTFT, TPOT, ITL between streamed chunks, duration) per server.
  [ -n "${VBENCH:-}" ] || return 0
  echo "== $1: vllm bench serve (random-mm)"
  PEER=$PEER "$PEERS_DIR/bench-serve.sh" --backend openai-chat --endpoint /v1/chat/completions --base-url "$URL" \
    --model "$MODEL_DIR" --served-model-name "$2" --tokenizer "$MODEL_DIR" --dataset-name random-mm --random-input-len 64 \
    --random-output-len 32 --num-prompts 16 --random-mm-base-items-per-request 1 \
    --random-mm-bucket-config '{(256, 256, 1): 1.0}' --random-mm-limit-mm-per-prompt '{"image": 1, "video": 0}' \
    --ignore-eos --max-concurrency 8 --seed 11 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    2>&1 | grep -v "it/s\]" | tee "$OUT/$1-vbench-random-mm.txt"
}

bench() {  # $1: server name, $2: workload, then the bench command and its options
  local name=$1 workload=$2
  shift 2
  echo "== $name: $workload"
  $PY -m bench "$@" --json "$OUT/$name-$workload.json" --png "$OUT/$name-$workload.png" | tee "$OUT/$name-$workload.txt"
}

workloads() {  # $1: server name
  [ -z "${VBENCH_ONLY:-}" ] || return 0
  bench "$1" chats8 serve --url "$URL" --rate inf --num-requests 8 --image-fraction 0 --max-tokens 256
  bench "$1" stall stall --url "$URL" --chats 8 --images 2 --after-steps 16
  bench "$1" mixed24 serve --url "$URL" --rate 1 --num-requests 24 --image-fraction 0.25 --max-tokens 64 --seed 0
}

if [ "$WHICH" = vllm ] || [ "$WHICH" = both ]; then
  start_vllm
  workloads vllm
  [ -n "${VBENCH_ONLY:-}" ] || bench vllm text32 serve --url "$URL" --rate inf --num-requests 32 --image-fraction 0 --max-tokens 64
  vbench vllm "$MODEL_DIR"
  stop_server
fi
if [ "$WHICH" = vlmcap ] || [ "$WHICH" = both ]; then
  start_vlmcap
  workloads "$VLMCAP_NAME"
  [ -n "${VBENCH_ONLY:-}" ] || bench "$VLMCAP_NAME" text32 serve --url "$URL" --rate inf --num-requests 32 --image-fraction 0 --max-tokens 64
  vbench "$VLMCAP_NAME" dummy:smolvlm-256m
  stop_server
fi
if [ "$WHICH" = llama ]; then
  start_llama
  workloads "llama-$LLAMA_TYPE"
  [ -n "${VBENCH_ONLY:-}" ] || bench "llama-$LLAMA_TYPE" text32 serve --url "$URL" --rate inf --num-requests 32 --image-fraction 0 --max-tokens 64
  vbench "llama-$LLAMA_TYPE" "$MODEL_DIR"
  stop_server
fi

$PY -m bench.side_by_side "$OUT"
