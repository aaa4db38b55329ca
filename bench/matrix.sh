#!/usr/bin/env bash
# The workload matrix of issue 34: one command that runs tokengate's configs and the SGLang
# model gateway (smg) side by side, in the same run, over about a dozen workload cells and
# several seeds, and prints the scorecard (bench/matrix_scorecard.py).
#
# The cells are defined in bench/matrix.py (`python3 bench/matrix.py list`): tenants few
# (hot tenant larger than one engine) or many (Zipf 1.1); system prompts ~1k / ~4k / ~12k
# tokens; agents (0.1 s think) or people (1-5 s); all, half or none of the sessions with a
# session header, a share of one-shots; engine prefix cache a fifth / half / all of the hot
# working set; load moderate / high / overload (1.3x the fleet's prefill capacity at ideal
# reuse); 4 equal, 8 equal or 4 mixed engines (two at half the prefill rate); prefill
# serialized or chunked. Time is scaled (SIM_TIME_SCALE): a cell sends ~REQ_RATE requests
# per real second for DURATION seconds; the first WARMUP seconds are left out of the figures
# (TTFT from the requests sent after it; the cached ratio from the engines' own counters,
# read at the end of the warm-up and at the end).
#
# For every cell in CELLS and seed in SEEDS, each config in CONFIGS replays the same workload
# against its own fresh fleet (cold caches); the configs of one (cell, seed) run one after
# the other, their order rotated by seed. Configs:
#   tg-nokey          tokengate, no scheduling key at all (what a service gets by default)
#   tg-layered        tokengate `scheduler: {mode: layered}`
#   tg-policy         tokengate policy mode, the `agents` service of conf/policy.yaml
#   smg-cache-aware   smg launch --policy cache_aware
#   smg-rr            smg launch --policy round_robin (the floor)
# A tokengate config is bench/matrix/<name>.yaml (else bench/tail/<name>.yaml): the
# service's keys, not indented, or a line "# from: FILE SERVICE" that takes that service's
# keys (all but its instances) from a config file (tg-policy: conf/policy.yaml's agents);
# a line "# bin: PATH" runs it on that gateway binary (A/B of two builds: copy the old
# build out of target/release first); smg-<policy> runs smg with that --policy.
# NAME@2 (@3, …) beside NAME runs NAME again on the same seed; the scorecard takes each
# seed's median over the runs (tokengate repeats a seed within milliseconds, smg's p99 can
# differ 2x between two runs of one seed: one draw of it decides a cell's ratio). A second
# invocation with the same RUN adds its configs to that run (its command is appended).
#
# Capacity cells (not in the default CELLS; `CELLS="cap-add cap-crash"`, ~12 min):
#   cap-add    three engines at the high load; at CAP_AT s a fourth joins (tokengate: the
#              config file gains it + SIGHUP; smg: POST /workers)
#   cap-crash  four engines; e2 is SIGKILLed at CAP_AT s and restarted CAP_DOWN s later
#              (same port, cold cache)
# Their figures: the requests per engine per CAP_BUCKET seconds, and each engine's prefill
# queue (requests waiting or prefilling, polled every second: queues.jsonl).
#
# Usage: bench/matrix.sh                       (builds target/release/tokengate; BUILD=0 skips)
#        CELLS=few-4k-people-half-high SEEDS=1 bench/matrix.sh     one cell, one seed
#        SCORE_ONLY=1 RUN=<name> bench/matrix.sh                   the scorecard again
# Knobs: CELLS, SEEDS ("1 2 3"), CONFIGS, SIM_TIME_SCALE (4), REQ_RATE (12 requests/s),
#   DURATION (10 s), WARMUP (2.5 s), DRAIN (6 s), OVERLOAD_DURATION (30 s), OVERLOAD_DRAIN (40 s), CAP_DURATION (20 s), CAP_AT (6 s),
#   CAP_DOWN (4 s), CAP_BUCKET (4 s), ADMIT_AT_PREFILL (1: the engines look a queued
#   request's prefix up when its prefill starts, as vLLM and SGLang do, engine-sim's
#   --admit-at-prefill; 0: when it arrives, engine-sim's default, on which runs 1-27 of
#   docs/matrix-runs.md ran), RUN (a name, default the date), OUT
#   (target/bench/matrix/$RUN), GW_LOG (the gateway's RUST_LOG; its log is then kept).
# Writes (never into bench/results): $OUT/<cell>/cell.json, $OUT/<cell>/s<seed>/<config>/
#   {report.json, requests.jsonl.gz, engines0.json, engines.json, summary.json, replay.log,
#   gateway.yaml, gateway.metrics.txt | router.txt}, $OUT/scorecard.md.
# Needs: cargo, python3, curl, smg (pip install smg).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

export SIM_TIME_SCALE=${SIM_TIME_SCALE:-4} REQ_RATE=${REQ_RATE:-12} DURATION=${DURATION:-10}
export WARMUP=${WARMUP:-2.5} DRAIN=${DRAIN:-6} CAP_DURATION=${CAP_DURATION:-20} CAP_BUCKET=${CAP_BUCKET:-4}
export OVERLOAD_DURATION=${OVERLOAD_DURATION:-30} OVERLOAD_DRAIN=${OVERLOAD_DRAIN:-40}
export ADMIT_AT_PREFILL=${ADMIT_AT_PREFILL:-1}
CAP_AT=${CAP_AT:-6}
CAP_DOWN=${CAP_DOWN:-4}
CELLS=${CELLS:-$(python3 bench/matrix.py names)}
SEEDS=${SEEDS:-"1 2 3"}
CONFIGS=${CONFIGS:-"tg-nokey tg-layered tg-policy smg-cache-aware smg-cache-aware@2 smg-rr"}
RUN=${RUN:-$(date -u +%Y%m%d-%H%M%S)}
OUT=${OUT:-target/bench/matrix/$RUN}
MODEL=qwen3-0.6b
BLOCK_SIZE=16
BIN=${BIN:-$ROOT/target/release/tokengate}

config_file() { # tokengate config name → its file, or nothing
  local f
  for f in "bench/matrix/$1.yaml" "bench/tail/$1.yaml"; do [ -f "$f" ] && { echo "$f"; return; }; done
}
kind_of() {
  case $1 in
    smg-*) echo smg;;
    *) if [ -n "$(config_file "${1%@*}")" ]; then echo tg; else echo unknown; fi;;
  esac
}
smg_policy() { local c=${1%@*}; case $c in smg-rr) echo round_robin;; *) local p=${c#smg-}; echo "${p//-/_}";; esac; }

for c in $CONFIGS; do
  [ "$(kind_of "$c")" != unknown ] || { echo "unknown config '$c': add bench/matrix/$c.yaml" >&2; exit 1; }
  [ "$(kind_of "$c")" != smg ] || command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; }
done
for cell in $CELLS; do python3 bench/matrix.py env "$cell" >/dev/null; done

if [ -n "${SCORE_ONLY:-}" ]; then
  python3 bench/matrix_scorecard.py "$OUT" | tee "$OUT/scorecard.md"
  exit 0
fi

. bench/lib.sh

n_seeds=$(wc -w <<<"$SEEDS"); n_configs=$(wc -w <<<"$CONFIGS")
est=$(python3 bench/matrix.py estimate "$CELLS" "$n_seeds" "$n_configs")
echo "matrix: $(wc -w <<<"$CELLS") cells x $n_seeds seeds x $n_configs configs, estimated $((est / 60)) min $((est % 60)) s (plus the build); results in $OUT" >&2

if [ "${BUILD:-1}" = 1 ]; then
  cargo build --release --bin tokengate --quiet
fi
[ -x "$BIN" ] || { echo "no $BIN (run without BUILD=0)" >&2; exit 1; }
mkdir -p "$OUT"
{ git rev-parse --short HEAD; git status --porcelain -- . ':!bench/results' | head -1; } >"$OUT/build.txt" 2>/dev/null || true
CMD=""
for v in CELLS SEEDS CONFIGS SIM_TIME_SCALE REQ_RATE DURATION WARMUP DRAIN OVERLOAD_DURATION OVERLOAD_DRAIN CAP_DURATION CAP_AT CAP_DOWN CAP_BUCKET ADMIT_AT_PREFILL; do
  case "${!v}" in *' '*) CMD="$CMD$v=\"${!v}\" ";; *) CMD="$CMD$v=${!v} ";; esac
done
printf '%sbench/matrix.sh\n' "$CMD" >>"$OUT/command.txt"
T0=$(date +%s)

# Engine i (1-based) of the cell, on a free port (or on $2 when given: a restart).
start_engine() {
  local i=$1 listen=127.0.0.1:${2:-0}
  # shellcheck disable=SC2086 # the cell's flags are a list
  RUST_LOG=warn "$BIN" engine-sim --listen "$listen" --id "e$i" --model "$MODEL" \
    ${CELL_SIM_FLAGS[$((i-1))]} 2>"$WORK/sim$i.log" >/dev/null &
  ENGINE_PIDS[$((i-1))]=$!; PIDS+=($!)
}
start_cell_fleet() {
  ENGINE_IDS=(); ENGINE_URLS=(); ENGINE_PIDS=()
  local i
  for i in $(seq 1 "$CELL_ENGINES"); do ENGINE_IDS+=("e$i"); start_engine "$i"; done
  for i in $(seq 1 "$CELL_ENGINES"); do
    ENGINE_URLS+=("$(wait_line "$WORK/sim$i.log" 'listening on http://')")
    wait_http "${ENGINE_URLS[$((i-1))]}/health"
  done
}
engine_stats() { # → one JSON object of every engine's /admin/stats (null when down)
  local i
  echo "{"
  for i in $(seq 1 "$CELL_ENGINES"); do
    printf '"e%d": %s%s\n' "$i" "$(curl -sf -m 2 "${ENGINE_URLS[$((i-1))]}/admin/stats" || echo null)" \
      "$([ "$i" -lt "$CELL_ENGINES" ] && echo ,)"
  done
  echo "}"
}

# The capacity event of cap-add / cap-crash (run CAP_AT s after the replay started).
capacity_event() { # $1 = cell, $2 = config kind
  case $1 in
    cap-add)
      local url=${ENGINE_URLS[3]}
      if [ "$2" = tg ]; then
        echo "      - { id: e4, addr: \"${url#http://}\" }" >>"$WORK/gw.yaml"
        "$BIN" check -c "$WORK/gw.yaml" >/dev/null && kill -HUP "$GW_PID"
      else
        curl -sf -o /dev/null -X POST "$SMG_URL/workers" -H 'content-type: application/json' \
          -d "{\"url\": \"$url\"}" || echo "   smg refused the new worker" >&2
      fi
      echo "e4 added at ${CAP_AT}s" >"$RUN_DIR/event.txt"
      echo "{\"engine\": \"e4\", \"from_s\": $CAP_AT}" >"$RUN_DIR/event.json";;
    cap-crash)
      local port=${ENGINE_URLS[1]##*:}
      kill -9 "${ENGINE_PIDS[1]}" 2>/dev/null || true
      stop "${ENGINE_PIDS[1]}"
      sleep "$CAP_DOWN"
      start_engine 2 "$port"
      wait_line "$WORK/sim2.log" 'listening on http://' >/dev/null
      echo "e2 killed at ${CAP_AT}s, restarted (cold) ${CAP_DOWN}s later" >"$RUN_DIR/event.txt"
      echo "{\"engine\": \"e2\", \"from_s\": $(awk -v a="$CAP_AT" -v b="$CAP_DOWN" 'BEGIN { print a + b }')}" >"$RUN_DIR/event.json";;
  esac
}

run_one() { # $1 = cell, $2 = seed, $3 = config
  local cell=$1 seed=$2 name=$3 kind t1; t1=$(date +%s); kind=$(kind_of "$name")
  RUN_DIR=$OUT/$cell/s$seed/$name
  rm -rf "$RUN_DIR"; mkdir -p "$RUN_DIR"
  echo "== $cell seed $seed: $name" >&2
  start_cell_fleet
  local n_routed=$CELL_ENGINES
  [ "$cell" != cap-add ] || n_routed=$((CELL_ENGINES - 1))
  local target
  case $kind in
    tg)
      local f from body; f=$(config_file "${name%@*}")
      from=$(sed -n 's/^# from: *//p' "$f" | head -1)
      if [ -n "$from" ]; then # "# from: FILE SERVICE": that service's keys in that file
        body=$(service_keys "${from%% *}" "${from#* }")
        [ -n "$body" ] || { echo "no service '${from#* }' in ${from%% *}" >&2; exit 1; }
      else
        body=$({ grep -v '^#' "$f" || true; } | sed 's/^/    /') # tg-nokey: no key at all
      fi
      # "# bin: PATH" runs this config on another gateway binary (an A/B of two builds).
      local gwbin; gwbin=$(sed -n 's/^# bin: *//p' "$f" | head -1)
      BIN=${gwbin:-$BIN} ENGINES=$n_routed start_tokengate "$body"
      [ -z "$gwbin" ] || echo "$gwbin" >"$RUN_DIR/binary.txt"
      cp "$WORK/gw.yaml" "$RUN_DIR/gateway.yaml"
      target=$GW_URL;;
    smg)
      if ! start_smg "$(smg_policy "$name")" --worker-urls "${ENGINE_URLS[@]:0:$n_routed}" 2>"$RUN_DIR/smg_start.log"; then
        echo "   smg did not start (see $RUN_DIR/smg_start.log): run skipped" >&2
        [ -z "$SMG_PID" ] || stop "$SMG_PID"
        stop "${ENGINE_PIDS[@]}"
        return 0
      fi
      echo "smg $(smg --version 2>&1 | head -1) launch --policy $(smg_policy "$name") (defaults otherwise)" >"$RUN_DIR/router.txt"
      target=$SMG_URL;;
  esac
  # shellcheck disable=SC2086 # CELL_WL_FLAGS is a list of flags
  timeout -k 5 "$(awk -v a="$CELL_DURATION" -v b="$CELL_DRAIN" 'BEGIN { printf "%d", a + b + 60 }')" "$BIN" bench replay --model "$MODEL" \
    --url "$target" $CELL_WL_FLAGS --seed "$seed" --duration "${CELL_DURATION}s" --drain-timeout "${CELL_DRAIN}s" \
    --out-json "$RUN_DIR/report.json" --out-requests "$RUN_DIR/requests.jsonl" \
    >/dev/null 2>"$RUN_DIR/replay.log" &
  local replay=$!; PIDS+=($replay)
  local t_replay; t_replay=$(date +%s.%N)
  local poller=
  if [[ $cell == cap-* ]]; then # each engine's prefill queue (waiting + prefilling), every second
    (
      while :; do
        line="{\"t\": $(awk -v t0="$t_replay" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - t0 }')"
        for i in $(seq 1 "$CELL_ENGINES"); do
          q=$(curl -sf -m 1 "${ENGINE_URLS[$((i-1))]}/admin/stats" | grep -oE '"prefill_phase":[0-9]+' | cut -d: -f2 || true)
          line="$line, \"e$i\": ${q:-null}"
        done
        echo "$line}"
        sleep 1
      done
    ) >"$RUN_DIR/queues.jsonl" 2>/dev/null &
    poller=$!; PIDS+=($poller)
  fi
  sleep "$WARMUP"
  engine_stats >"$RUN_DIR/engines0.json"
  if [[ $cell == cap-* ]]; then
    sleep "$(awk -v t0="$t_replay" -v now="$(date +%s.%N)" -v at="$CAP_AT" 'BEGIN { d = t0 + at - now; printf "%.2f", (d > 0 ? d : 0) }')"
    capacity_event "$cell" "$kind"
  fi
  wait "$replay" || echo "   replay failed (exit $?), see $RUN_DIR/replay.log" >&2
  stop "$replay"
  [ -z "$poller" ] || stop "$poller"
  if [[ $cell == cap-crash ]]; then # the restarted engine's URL is the same
    wait_http "${ENGINE_URLS[1]}/health"
  fi
  engine_stats >"$RUN_DIR/engines.json"
  if [ "$kind" = tg ]; then
    curl -sf "$GW_ADMIN/metrics" | grep -E '^tokengate_(prefix_|routing_decisions|requests_total)' >"$RUN_DIR/gateway.metrics.txt" || true
    grep -ciE 'error|panic' "$WORK/gw.log" >"$RUN_DIR/gateway_log_errors.txt" || true
    [ -z "${GW_LOG:-}" ] || gzip -c "$WORK/gw.log" >"$RUN_DIR/gateway.log.gz"
    stop "$GW_PID"
  else
    tail -n 50 "$WORK/smg.log" >"$RUN_DIR/smg.log.tail"
    stop "$SMG_PID"
  fi
  stop "${ENGINE_PIDS[@]}"
  [ ! -f "$RUN_DIR/requests.jsonl" ] || gzip -f "$RUN_DIR/requests.jsonl"
  echo "$(( $(date +%s) - t1 ))" >"$RUN_DIR/wall_s.txt"
  python3 bench/matrix.py summarize "$RUN_DIR" || true
}

for cell in $CELLS; do
  eval "$(python3 bench/matrix.py env "$cell")"
  mkdir -p "$OUT/$cell"
  printf '%s\n' "$CELL_JSON" >"$OUT/$cell/cell.json"
  configs=($CONFIGS)
  if [[ $cell == cap-* ]]; then # round-robin says nothing about new capacity
    configs=(); for c in $CONFIGS; do [ "${c%@*}" = smg-rr ] || configs+=("$c"); done
  fi
  k=0
  for seed in $SEEDS; do
    n=${#configs[@]}
    for j in $(seq 0 $((n - 1))); do run_one "$cell" "$seed" "${configs[$(((j + k) % n))]}"; done
    k=$((k + 1))
  done
done
echo "$(( $(date +%s) - T0 ))" >"$OUT/wall_s.txt"
python3 bench/matrix_scorecard.py "$OUT" | tee "$OUT/scorecard.md"
