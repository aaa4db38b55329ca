#!/usr/bin/env bash
# TTFT tail on a multi-tenant agentic workload (issue 12): tokengate's schedulers and the
# SGLang model gateway side by side, in the same run, over several seeds and two loads.
#
# The load (`tokengate bench replay --agentic`): TENANTS tenants, each with its own long
# system prompt (SYSTEM_TOKENS), Zipf(ZIPF) popularity; sessions arrive as a Poisson process
# (the load's rate, sessions/s) for DURATION seconds; ONE_SHOT of them are single requests,
# the others run TURNS turns that resend the growing history plus a tool-result-sized user
# message (USER_TOKENS) THINK_TIME after the previous answer (OUTPUT_TOKENS). The engines:
# ENGINES engine-sim processes whose KV caches hold only part of the working set
# (KV_BLOCKS blocks of BLOCK_SIZE tokens) and whose prefill is the bottleneck (PREFILL_TPS
# uncached tokens/s, serialized), all durations divided by SIM_TIME_SCALE.
#
# For every load in LOADS and every seed in SEEDS, each config in CONFIGS replays the same
# workload (same seed, same rate) against its own fresh fleet (cold caches):
#   tg-layered        tokengate layered, defaults (affinity: {}, prefix: {})
#   tg-layered-loose  tokengate layered, prefix {min_hit_ratio 0.1, load_tolerance 3, waiting_threshold 16}
#   tg-policy         tokengate policy: session-affinity ×1, least-inflight ×1, prefix-cache ×2
#   tg-least-token    tokengate least-token (no scheduler)
#   smg-cache-aware   smg --policy cache_aware
#   smg-rr            smg --policy round_robin
# A tokengate config is the file bench/tail/<name>.yaml: the service's load_balancing /
# scheduler keys (indented as at the top level; the script puts them into the service). Any
# name with such a file works in CONFIGS without editing this script (its first
# "# label: …" line names the row; lines after a "# top-level:" line go to the gateway's top
# level, e.g. cost_model; a "# instance: cache_tokens" line gives every instance
# `cache_tokens: KV_BLOCKS × 16`, the engines' cache size; a "# prefix_index: k: v" line adds
# keys to the gateway's prefix_index). Also accepted: smg-<policy> (e.g. smg-power-of-two →
# smg --policy power_of_two) and direct-rr (the client round-robins over the engines).
#
# Defaults and why (2 cores shared by the load generator, the router and the engines; the
# numbers come from calibration runs of this script, see bench/README.md):
#   ENGINES=4, KV_BLOCKS=2048 blocks of 16 tokens = 32 k tokens per engine: about ten of the
#     tenants' 2-4 k-token system prompts. A 40-s run uses ~26-30 of the 40 tenants (~90 k
#     tokens of system prompts) plus the live sessions' histories (3-9 k tokens each): one
#     engine never holds the working set, the fleet (131 k tokens) only about holds its hot
#     part when tenants are partitioned, and every config evicts.
#   PREFILL_TPS=2000, SIM_TIME_SCALE=4: 8 k prefill tokens per real second per engine. The mean
#     prompt is ~5 k tokens of which ~0.7 k are new when the prefix is reused (the ideal ratio
#     is ~0.86): an engine prefills ~11 requests/s with reuse and ~1.6/s without, so prefill is
#     the bottleneck as soon as routing loses the prefix; a decode step is ~2 ms real.
#   TENANTS=40, ZIPF=1.1 (the top tenant has 27 % of the sessions, the top ten 73 %),
#     SYSTEM_TOKENS=2048-4096, USER_TOKENS=128-640 (tool results), OUTPUT_TOKENS=32-128,
#     ONE_SHOT=0.25, TURNS=2-12, THINK_TIME=100ms (agents answer fast).
#   RATE_MODERATE=1.5 sessions/s (~8 requests/s): round-robin's p99 TTFT is 1.1-1.7 s.
#   RATE_HIGH=3 sessions/s (~10-18 requests/s): round-robin's p99 TTFT is 8-22 s (it falls
#     behind and sends fewer turns; some requests may still run at the end of the drain), the
#     cache-aware routers' is 0.5-1.7 s.
#   DURATION=40 s of arrivals, DRAIN=15 s: a run takes ~45 s (round-robin at the high load
#     ~55 s); 6 configs × 2 loads × 3 seeds ≈ 26 min plus the release build.
#
# Usage: bench/tail.sh        (from anywhere; builds target/release/tokengate first, BUILD=0 skips)
# Knobs (environment): SEEDS ("1 2 3"), LOADS ("moderate high"), RATE_MODERATE, RATE_HIGH,
#   CONFIGS, ENGINES, KV_BLOCKS, PREFILL_TPS, SIM_TIME_SCALE, MAX_RUNNING, TENANTS, ZIPF,
#   SYSTEM_TOKENS, USER_TOKENS, OUTPUT_TOKENS, ONE_SHOT, TURNS, THINK_TIME, DURATION (s),
#   DRAIN (s), OUT (per-run results, default target/bench/tail: git-ignored), MD (the markdown
#   report), PLOTS (where the SVG plots go, default bench/results/tail), TABLE_ONLY=1 (rewrite MD
#   and the plots from the results in OUT without running anything), KEEP_REQUESTS=1 (keep every
#   request's record — tenant, session, turn, instance, TTFT, tokens — as requests.jsonl.gz),
#   GW_LOG (the gateway's RUST_LOG, e.g. "warn,tokengate=debug" for every routing decision's
#   explanation; the log is kept as gateway.log.gz).
# The text after "<!-- discussion -->" in the existing MD file is kept when it is rewritten.
# Needs: cargo, python3, curl, smg (pip install smg) for smg-* configs.
# Writes: bench/results/tail.md, bench/results/tail/<load>-ttft.svg (TTFT p50/p90/p99 per
# config and seed), bench/results/tail/<load>-tail.svg (share of requests with TTFT ≥ x per config, seeds pooled),
# and the raw per-run results (not committed) under target/bench/tail/<load>/s<seed>/<config>/
# {report.json,report.md,ttft_ms.json,engines.json,gateway.yaml,gateway.metrics.txt,instances.json,…}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SEEDS=${SEEDS:-"1 2 3"}
LOADS=${LOADS:-"moderate high"}
RATE_MODERATE=${RATE_MODERATE:-1.5}
RATE_HIGH=${RATE_HIGH:-3}
DEFAULT_CONFIGS="tg-layered tg-layered-loose tg-policy tg-least-token smg-cache-aware smg-rr"
CONFIGS=${CONFIGS:-$DEFAULT_CONFIGS}
ENGINES=${ENGINES:-4}
KV_BLOCKS=${KV_BLOCKS:-2048}
BLOCK_SIZE=16 # engine-sim KV block (tokens) = the gateway's prefix_index.block_size
PREFILL_TPS=${PREFILL_TPS:-2000}
SIM_TIME_SCALE=${SIM_TIME_SCALE:-4}
MAX_RUNNING=${MAX_RUNNING:-64}
TENANTS=${TENANTS:-40}
ZIPF=${ZIPF:-1.1}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-2048-4096}
USER_TOKENS=${USER_TOKENS:-128-640}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-32-128}
ONE_SHOT=${ONE_SHOT:-0.25}
TURNS=${TURNS:-2-12}
THINK_TIME=${THINK_TIME:-100ms}
DURATION=${DURATION:-40}
DRAIN=${DRAIN:-15}
OUT=${OUT:-target/bench/tail}
PLOTS=${PLOTS:-bench/results/tail}
MD=${MD:-bench/results/tail.md}
MODEL=qwen3-0.6b

rate_of() { # load name → sessions/s
  local v="RATE_${1^^}"
  [ -n "${!v:-}" ] || { echo "no rate for load '$1': set $v" >&2; exit 1; }
  echo "${!v}"
}
kind_of() { # config name → tg | smg | direct | unknown
  case $1 in
    smg-*) echo smg;;
    direct-rr) echo direct;;
    *) if [ -f "bench/tail/$1.yaml" ]; then echo tg; else echo unknown; fi;;
  esac
}
smg_policy() { # smg-cache-aware → cache_aware, smg-rr → round_robin
  case $1 in
    smg-rr) echo round_robin;;
    *) local p=${1#smg-}; echo "${p//-/_}";;
  esac
}

for l in $LOADS; do rate_of "$l" >/dev/null; done
for c in $CONFIGS; do
  if [ "$(kind_of "$c")" = unknown ]; then
    echo "unknown config '$c': add bench/tail/$c.yaml (a service's load_balancing/scheduler keys)" >&2
    exit 1
  fi
  [ "$(kind_of "$c")" != smg ] || command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "python3 missing" >&2; exit 1; }

. bench/lib.sh

T0=$(date +%s)
BIN=$ROOT/target/release/tokengate
SIM_FLAGS="--time-scale $SIM_TIME_SCALE --kv-blocks $KV_BLOCKS --block-size $BLOCK_SIZE --prefill-tps $PREFILL_TPS --max-running $MAX_RUNNING"
WL_FLAGS="--agentic --tenants $TENANTS --zipf $ZIPF --system-tokens $SYSTEM_TOKENS --user-tokens $USER_TOKENS --output-tokens $OUTPUT_TOKENS --one-shot $ONE_SHOT --turns $TURNS --think-time $THINK_TIME --engine-block-size $BLOCK_SIZE --duration ${DURATION}s --drain-timeout ${DRAIN}s"

if [ -z "${TABLE_ONLY:-}" ]; then
  if [ "${BUILD:-1}" = 1 ]; then
    ./scripts/setup.sh
    cargo build --release --bin tokengate --quiet
  fi
  [ -x "$BIN" ] || { echo "no $BIN (run without BUILD=0)" >&2; exit 1; }
  mkdir -p "$OUT"
  printf 'sim: %s\nworkload: %s\n' "$SIM_FLAGS" "$WL_FLAGS" >"$OUT/flags.txt"
  # the commit the binary was built from, and whether the tree had other changes
  { git rev-parse --short HEAD; git status --porcelain -- . ':!bench/results' | head -1; } >"$OUT/build.txt" 2>/dev/null || true
fi

run_one() { # $1 = load, $2 = seed, $3 = config
  local load=$1 seed=$2 name=$3 rate t1; t1=$(date +%s)
  rate=$(rate_of "$load")
  local dir=$OUT/$load/s$seed/$name
  rm -rf "$dir"; mkdir -p "$dir"
  echo "== $load (rate $rate/s) seed $seed: $name" >&2
  start_fleet
  local target=() kind; kind=$(kind_of "$name")
  case $kind in
    tg)
      # Lines after a "# top-level:" line are gateway-wide keys (e.g. cost_model); a
      # "# instance: cache_tokens" line gives every instance the engines' KV cache size.
      # ("# instance: cache_tokens 1.25": that many times the engines' size). A
      # "# prefix_index: k: v" line adds keys to the gateway's prefix_index.
      INSTANCE_KEYS=
      PREFIX_INDEX_KEYS=$(sed -n 's/^# prefix_index: */, /p' "bench/tail/$name.yaml" | head -1)
      if grep -q '^# instance: cache_tokens' "bench/tail/$name.yaml"; then
        local f; f=$(sed -n 's/^# instance: cache_tokens *//p' "bench/tail/$name.yaml" | head -1)
        INSTANCE_KEYS=", cache_tokens: $(awk -v k="$((KV_BLOCKS * BLOCK_SIZE))" -v f="${f:-1}" 'BEGIN { printf "%d", k * f }')"
      fi
      INSTANCE_KEYS=$INSTANCE_KEYS PREFIX_INDEX_KEYS=$PREFIX_INDEX_KEYS start_tokengate "$(sed '/^# top-level:/,$d; s/^/    /' "bench/tail/$name.yaml")" "" \
        "$(sed -n '/^# top-level:/,${/^# top-level:/d;p}' "bench/tail/$name.yaml")"
      cp "$WORK/gw.yaml" "$dir/gateway.yaml"
      target=(--url "$GW_URL");;
    smg)
      start_smg "$(smg_policy "$name")"
      echo "smg $(smg --version 2>&1 | head -1) launch --policy $(smg_policy "$name") (defaults otherwise)" >"$dir/router.txt"
      target=(--url "$SMG_URL");;
    direct)
      local u; for u in "${ENGINE_URLS[@]}"; do target+=(--url "$u"); done
      target+=(--url-policy round-robin)
      echo "client round-robin over the engines" >"$dir/router.txt";;
  esac
  # shellcheck disable=SC2086 # WL_FLAGS is a list of flags
  timeout -k 5 $((DURATION + DRAIN + 60)) "$BIN" bench replay --model "$MODEL" "${target[@]}" \
    $WL_FLAGS --seed "$seed" --rate "$rate" \
    --out-json "$dir/report.json" --out-md "$dir/report.md" --out-requests "$WORK/requests.jsonl" \
    >/dev/null 2>"$dir/replay.log" || echo "   replay failed (exit $?), see $dir/replay.log" >&2
  if [ "$kind" = tg ]; then
    sleep 0.5 # let the last usage records land
    curl -sf "$GW_ADMIN/metrics" | grep -E '^tokengate_(prefix_|routing_decisions|requests_total|tokens_total|sessions)' >"$dir/gateway.metrics.txt" || true
    curl -sf "$GW_ADMIN/admin/instances" >"$dir/instances.json" || true
    grep -ciE 'error|panic' "$WORK/gw.log" >"$dir/gateway_log_errors.txt" || true
    stop "$GW_PID"
    if [ -n "${GW_LOG:-}" ]; then gzip -c "$WORK/gw.log" >"$dir/gateway.log.gz"; fi
  elif [ "$kind" = smg ]; then
    tail -n 50 "$WORK/smg.log" >"$dir/smg.log.tail"
    stop "$SMG_PID"
  fi
  # each engine's own view (KV evictions, peak waiting, prefix hits)
  local i
  {
    echo "{"
    for i in $(seq 1 "$ENGINES"); do
      printf '"e%d": %s%s\n' "$i" "$(curl -sf "${ENGINE_URLS[$((i-1))]}/admin/stats" || echo null)" "$([ "$i" -lt "$ENGINES" ] && echo ,)"
    done
    echo "}"
  } >"$dir/engines.json"
  stop "${ENGINE_PIDS[@]}"
  echo "$(( $(date +%s) - t1 ))" >"$dir/wall_s.txt"
  python3 - "$dir" "$WORK/requests.jsonl" "$((PREFILL_TPS * SIM_TIME_SCALE))" >&2 <<'PY'
import json, os, sys
d, reqs, tps = sys.argv[1], sys.argv[2], float(sys.argv[3])
if not os.path.exists(os.path.join(d, "report.json")):
    print("   no report"); sys.exit(0)
rs = [json.loads(l) for l in open(reqs) if '"ttft_ms"' in l and '"error"' not in l] if os.path.exists(reqs) else []
rs = [x for x in rs if x.get("ttft_ms") is not None]
t = sorted(round(x["ttft_ms"], 1) for x in rs)
json.dump(t, open(os.path.join(d, "ttft_ms.json"), "w"), separators=(",", ":"))
# Wait: each request's TTFT less its own prefill (the uncached tokens the engine reported at
# the engines' prefill rate): the time it spent behind other work (queue, others' prefills).
wait = sorted(x["ttft_ms"] - ((x.get("prompt_tokens") or 0) - (x.get("cached_tokens") or 0)) / tps * 1000 for x in rs)
if wait:
    q = lambda p: wait[min(len(wait) - 1, max(0, -(-len(wait) * p // 100) - 1))]
    json.dump({"p50": q(50), "p90": q(90), "p99": q(99)}, open(os.path.join(d, "wait_ms.json"), "w"))
r = json.load(open(os.path.join(d, "report.json"))); c = r["counts"]; s = r["ttft_ms"]; k = r["tokens"]
print("   ok %d/%d, TTFT p50 %.0f p90 %.0f p99 %.0f ms, cached %.1f %% (ideal %.1f %%), lag p99 %.0f ms, %s s" % (
    c["ok"], c["sent"], s["p50"], s["p90"], s["p99"], k["cached_ratio"] * 100, (k.get("ideal_token_hit_ratio") or 0) * 100,
    r["dispatch_lag_ms"]["p99"], open(os.path.join(d, "wall_s.txt")).read().strip()))
PY
  if [ -n "${KEEP_REQUESTS:-}" ] && [ -f "$WORK/requests.jsonl" ]; then
    gzip -c "$WORK/requests.jsonl" >"$dir/requests.jsonl.gz"
  fi
  rm -f "$WORK/requests.jsonl"
}

if [ -z "${TABLE_ONLY:-}" ]; then
  for load in $LOADS; do
    for seed in $SEEDS; do
      for c in $CONFIGS; do run_one "$load" "$seed" "$c"; done
    done
  done
fi
CMD=""
for v in SEEDS LOADS RATE_MODERATE RATE_HIGH CONFIGS ENGINES KV_BLOCKS PREFILL_TPS SIM_TIME_SCALE MAX_RUNNING TENANTS ZIPF SYSTEM_TOKENS USER_TOKENS OUTPUT_TOKENS ONE_SHOT TURNS THINK_TIME DURATION DRAIN; do
  case "${!v}" in *' '*) CMD="$CMD$v=\"${!v}\" ";; *) CMD="$CMD$v=${!v} ";; esac
done
[ "$OUT" = target/bench/tail ] || CMD="${CMD}OUT=$OUT "
[ "$MD" = bench/results/tail.md ] || CMD="${CMD}MD=$MD "
CMD="${CMD}bench/tail.sh"
if [ -z "${TABLE_ONLY:-}" ]; then
  WALL=$(( $(date +%s) - T0 ))
  printf '%s\n' "$CMD" >"$OUT/command.txt"
  echo "$WALL" >"$OUT/wall_s.txt"
else # the command, flags and wall time of the run that made the results
  [ -f "$OUT/command.txt" ] && CMD=$(cat "$OUT/command.txt")
  WALL=$(cat "$OUT/wall_s.txt" 2>/dev/null || echo 0)
  [ -f "$OUT/flags.txt" ] && SIM_FLAGS=$(sed -n 's/^sim: //p' "$OUT/flags.txt") && WL_FLAGS=$(sed -n 's/^workload: //p' "$OUT/flags.txt")
fi

# plots with the bench crate's plot code (a small binary of tokengate-bench)
cargo build -p tokengate-bench --bin tail-plot --quiet
PLOT=$ROOT/target/debug/tail-plot

export SIM_FLAGS WL_FLAGS ENGINES CMD WALL PLOT PLOTS
for v in $(compgen -v RATE_); do export "${v?}"; done
python3 bench/tail_report.py "$OUT" "$MD" "$LOADS" "$SEEDS" "$CONFIGS"
cat "$MD"
