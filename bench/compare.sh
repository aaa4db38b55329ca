#!/usr/bin/env bash
# Routing strategies side by side on the Mooncake conversation trace (issue 6).
#
# Every configuration replays the same trace slice (same seed, same time scale) against its
# own fresh fleet of 8 engine-sim processes, so every run starts with cold KV caches:
#   direct-rr        the replay client round-robins over the 8 engines itself (no gateway)
#   tg-rr            tokengate, load_balancing: round-robin
#   tg-least-token   tokengate, load_balancing: least-token
#   tg-layered       tokengate, scheduler layered (prefix layer only)
#   tg-layered-aff   tokengate, scheduler layered (soft session affinity + prefix), replay --sessions
#   tg-policy        tokengate, scheduler policy (prefix-cache ×2 + least-inflight ×1)
#   smg-rr           SGLang model gateway, --policy round_robin
#   smg-cache-aware  SGLang model gateway, --policy cache_aware
#
# Usage: bench/compare.sh            (from anywhere; about 8–9 minutes on 2 cores)
# Knobs (environment): LIMIT, TIME_SCALE, BLOCK_TOKENS, SIM_TIME_SCALE, KV_BLOCKS, ENGINES,
#   SEED, TRACE, CONFIGS="direct-rr tg-layered …" (a subset), OUT (results directory).
# Needs: cargo, python3, smg (pip install smg). Writes bench/results/routing.md and
# bench/results/routing/<config>/{report.json,report.md,ttft_cdf.svg,inflight.svg,…}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

LIMIT=${LIMIT:-1500}
TIME_SCALE=${TIME_SCALE:-10}
BLOCK_TOKENS=${BLOCK_TOKENS:-128}
SIM_TIME_SCALE=${SIM_TIME_SCALE:-2.5}
KV_BLOCKS=${KV_BLOCKS:-65536}
ENGINES=${ENGINES:-8}
SEED=${SEED:-0}
TRACE=${TRACE:-$ROOT/../shared/traces/mooncake_conversation_trace.jsonl}
[ -f "$TRACE" ] || TRACE=/work/shared/traces/mooncake_conversation_trace.jsonl
CONFIGS=${CONFIGS:-"direct-rr tg-rr tg-least-token tg-layered tg-layered-aff tg-policy smg-rr smg-cache-aware"}
OUT=${OUT:-bench/results/routing}
MD=${MD:-bench/results/routing.md}
MODEL=qwen3-0.6b
BLOCK_SIZE=16 # engine-sim KV block (tokens) = the gateway's prefix_index.block_size

command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 missing" >&2; exit 1; }
[ -f "$TRACE" ] || { echo "trace not found: $TRACE (set TRACE=…)" >&2; exit 1; }

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

T0=$(date +%s)
./scripts/setup.sh
cargo build --release --quiet
BIN=$ROOT/target/release/tokengate
mkdir -p "$OUT"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not ready: $1" >&2; return 1; }
# wait until FILE holds a line matching REGEX; print the URL at its end
wait_line() {
  local file=$1 re=$2
  for _ in $(seq 1 300); do
    if grep -qE "$re" "$file" 2>/dev/null; then grep -E "$re" "$file" | head -1 | grep -oE 'http://[0-9.:]+$'; return 0; fi
    sleep 0.1
  done
  echo "no line /$re/ in $file" >&2; cat "$file" >&2; return 1
}
stop() { # stop the PIDs given, forget them
  local p
  for p in "$@"; do kill "$p" 2>/dev/null || true; done
  for p in "$@"; do wait "$p" 2>/dev/null || true; done
  local keep=() q
  for q in "${PIDS[@]}"; do [[ " $* " == *" $q "* ]] || keep+=("$q"); done
  PIDS=("${keep[@]}")
}

ENGINE_URLS=(); ENGINE_PIDS=()
start_fleet() { # 8 fresh engine-sims on free ports: cold caches
  ENGINE_URLS=(); ENGINE_PIDS=()
  local i
  for i in $(seq 1 "$ENGINES"); do
    RUST_LOG=warn "$BIN" engine-sim --listen 127.0.0.1:0 --id "e$i" --model "$MODEL" \
      --time-scale "$SIM_TIME_SCALE" --kv-blocks "$KV_BLOCKS" --block-size "$BLOCK_SIZE" \
      2>"$WORK/sim$i.log" >/dev/null &
    ENGINE_PIDS+=($!); PIDS+=($!)
  done
  for i in $(seq 1 "$ENGINES"); do
    ENGINE_URLS+=("$(wait_line "$WORK/sim$i.log" 'listening on http://')")
    wait_http "${ENGINE_URLS[$((i-1))]}/health"
  done
}

GW_PID=; GW_URL=; GW_ADMIN=
start_tokengate() { # $1 = YAML service body (load_balancing / scheduler lines, indented 4)
  {
    echo 'listen: ["127.0.0.1:0"]'
    echo 'admin_listen: "127.0.0.1:0"'
    echo 'threads: 2'
    echo "prefix_index: { block_size: $BLOCK_SIZE }"
    echo 'services:'
    echo "  - name: $MODEL"
    printf '%s\n' "$1"
    echo '    instances:'
    local i
    for i in $(seq 1 "$ENGINES"); do
      echo "      - { id: e$i, addr: \"${ENGINE_URLS[$((i-1))]#http://}\" }"
    done
  } >"$WORK/gw.yaml"
  "$BIN" check -c "$WORK/gw.yaml" >/dev/null
  RUST_LOG=warn "$BIN" serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
  GW_PID=$!; PIDS+=($GW_PID)
  GW_URL=$(wait_line "$WORK/gw.out" 'proxy listening on http://')
  GW_ADMIN=$(wait_line "$WORK/gw.out" 'admin listening on http://')
  wait_http "$GW_ADMIN/health"
}

SMG_PID=; SMG_URL=
start_smg() { # $1 = policy
  local port; port=$(free_port)
  smg launch --worker-urls "${ENGINE_URLS[@]}" --policy "$1" --host 127.0.0.1 --port "$port" \
    --log-level warn >"$WORK/smg.log" 2>&1 &
  SMG_PID=$!; PIDS+=($SMG_PID)
  SMG_URL=http://127.0.0.1:$port
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null "$SMG_URL/health" && break
    kill -0 "$SMG_PID" 2>/dev/null || { cat "$WORK/smg.log" >&2; return 1; }
    sleep 0.1
  done
  wait_http "$SMG_URL/health"
  # the workers must be registered (health can answer before the worker probes finish)
  for _ in $(seq 1 300); do
    if curl -sf "$SMG_URL/v1/models" | grep -q "$MODEL"; then return 0; fi
    sleep 0.2
  done
  echo "smg has no worker serving $MODEL" >&2; cat "$WORK/smg.log" >&2; return 1
}

replay() { # $1 = config name, $2.. = extra replay args (URLs etc.)
  local name=$1; shift
  local dir=$OUT/$name
  rm -rf "$dir"; mkdir -p "$dir"
  "$BIN" bench replay --model "$MODEL" --trace "$TRACE" --limit "$LIMIT" \
    --time-scale "$TIME_SCALE" --block-tokens "$BLOCK_TOKENS" --seed "$SEED" \
    --out-json "$dir/report.json" --out-md "$dir/report.md" --plots "$dir" "$@" \
    >/dev/null 2>"$dir/replay.log"
}

run_config() {
  local name=$1 t1; t1=$(date +%s)
  echo "== $name" >&2
  start_fleet
  local extra=()
  case $name in
    direct-rr)
      local u; for u in "${ENGINE_URLS[@]}"; do extra+=(--url "$u"); done
      extra+=(--url-policy round-robin)
      replay "$name" "${extra[@]}";;
    tg-*)
      local body
      case $name in
        tg-rr) body='    load_balancing: round-robin';;
        tg-least-token) body='    load_balancing: least-token';;
        tg-layered) body=$'    load_balancing: least-token\n    scheduler: { mode: layered, prefix: {} }';;
        tg-layered-aff) body=$'    load_balancing: least-token\n    scheduler: { mode: layered, affinity: { mode: soft }, prefix: {} }'
          extra+=(--sessions);;
        tg-policy) body=$'    load_balancing: least-token\n    scheduler: { mode: policy, plugins: [ {kind: prefix-cache, weight: 2}, {kind: least-inflight, weight: 1} ] }';;
        *) echo "unknown config $name" >&2; return 1;;
      esac
      start_tokengate "$body"
      replay "$name" --url "$GW_URL" "${extra[@]}"
      cp "$WORK/gw.yaml" "$OUT/$name/gateway.yaml"
      sleep 0.5 # let the last usage records land
      curl -sf "$GW_ADMIN/metrics" >"$OUT/$name/metrics.txt"
      curl -sf "$GW_ADMIN/admin/instances" >"$OUT/$name/instances.json"
      grep -ciE 'error|panic' "$WORK/gw.log" >"$OUT/$name/gateway_log_errors.txt" || true
      tail -n 50 "$WORK/gw.log" >"$OUT/$name/gateway.log.tail"
      stop "$GW_PID";;
    smg-*)
      local pol; case $name in smg-rr) pol=round_robin;; smg-cache-aware) pol=cache_aware;; esac
      start_smg "$pol"
      replay "$name" --url "$SMG_URL"
      echo "smg launch --policy $pol (defaults otherwise)" >"$OUT/$name/smg.txt"
      tail -n 50 "$WORK/smg.log" >"$OUT/$name/smg.log.tail"
      stop "$SMG_PID";;
    *) echo "unknown config $name" >&2; return 1;;
  esac
  # engine-side view: each engine's own counters
  local i; : >"$OUT/$name/engines.metrics.txt"
  for i in $(seq 1 "$ENGINES"); do
    { echo "# engine e$i"; curl -sf "${ENGINE_URLS[$((i-1))]}/metrics" || true; } >>"$OUT/$name/engines.metrics.txt"
  done
  stop "${ENGINE_PIDS[@]}"
  echo "$(( $(date +%s) - t1 ))" >"$OUT/$name/wall_s.txt"
  echo "   $(grep -m1 -E 'requests/s|req/s' "$OUT/$name/report.md" || true) ($(cat "$OUT/$name/wall_s.txt") s)" >&2
}

for c in $CONFIGS; do run_config "$c"; done
WALL=$(( $(date +%s) - T0 ))

CMD="bench/compare.sh"
for v in LIMIT TIME_SCALE BLOCK_TOKENS SIM_TIME_SCALE KV_BLOCKS SEED; do CMD="$v=${!v} $CMD"; done
[ -n "${NO_TABLE:-}" ] && exit 0
python3 - "$OUT" "$MD" "$CMD" "$WALL" $CONFIGS <<'PY'
PY
cat "$MD"
