#!/usr/bin/env bash
# Prefill/decode disaggregation (issue 15): the same trace replayed, in the same run, against
# ENGINES integrated engine-sims and against a PD fleet of the same size (PREFILLS prefill +
# DECODES decode engines), through tokengate (both PD protocols) and through the SGLang model
# gateway's PD router.
#
# Configs (CONFIGS, in order; each run gets a fresh fleet, so caches start cold):
#   tg-integrated  tokengate, scheduler {mode: layered}, ENGINES integrated engines
#   tg-pd-sglang   tokengate, scheduler {mode: layered}, pd {mode: sglang-mooncake,
#                  decode_policy: least-token}; engines --role prefill|decode --pd-mode sglang,
#                  prefills with a bootstrap port of their own
#   tg-pd-vllm     the same with pd {mode: vllm-nixl} and --pd-mode vllm
#   smg-pd         smg launch --pd-disaggregation --policy cache_aware (smg's default, for the
#                  prefill and the decode pick), sglang engines as tg-pd-sglang, registered
#                  through smg's worker API (POST /workers {url, worker_type: prefill|decode,
#                  bootstrap_port, runtime_type: sglang}): given as --prefill URL PORT /
#                  --decode URL, smg detects engine-sim as vLLM and speaks the wrong protocol
#                  (see the probe below)
#   smg-integrated smg launch --worker-urls … --policy cache_aware, ENGINES integrated engines
#                  (optional)
# Runs are interleaved per seed (every config of seed 1, then seed 2, …) so that drift of
# the shared machine hits every config alike. Before the runs, when a smg config is listed,
# a probe starts smg the documented way (--prefill URL BOOTSTRAP_PORT --decode URL), sends one
# request and records what happened in OUT/smg-cli-probe.txt (SMG_PROBE=0 skips it).
#
# The workload: the Mooncake conversation trace (TRACE), LIMIT requests from record
# (seed − 1) × WINDOW on (each seed replays another stretch of the trace; --seed also changes
# the prompt text), at TIME_SCALE × the trace's speed, full size (long prompts: median ~8 k
# tokens, mean ~14 k; outputs: mean ~360 tokens), streamed. 300 records at 2.2× take 41-51 s.
#
# The engines (every duration divided by SIM_TIME_SCALE; the numbers are simulated ms):
#   PREFILL_CHUNK=2048: prefill and decode share an engine's compute (engine-sim
#     --prefill-chunk-tokens, chunked prefill): while an integrated engine prefills, each of
#     its decode steps also carries up to 2048 prompt tokens and lasts their prefill time
#     longer (128 ms at PREFILL_TPS=16000, against a DECODE_STEP_MS=10 decode step). This is
#     the interference PD removes; PREFILL_CHUNK=0 is engine-sim's older model, where prefill
#     runs beside the decode at no cost to it (an integrated engine is then a prefill unit
#     and a decode unit, and PD can only lose: it halves both).
#   PREFILL_TPS=16000, DECODE_STEP_MS=10, DECODE_PER_REQ_MS=0.3: an 8B-class model on one
#     GPU (an 8 k prompt prefills in 0.5 s; a 2048-token chunk makes a step ~13× longer).
#   KV_TRANSFER_MS=10 ms per 1 k prompt tokens (engine-sim's default, ~RDMA): 140 ms for a
#     14 k prompt, about a sixth of its prefill.
#   SIM_TIME_SCALE=3.3 with TIME_SCALE=2.2: the engines run 1.5× as fast as the trace's
#     real-time demand, so an integrated engine prefills ~30-45 % of a run and a PD fleet's
#     2 prefill engines ~65-80 % (PD concentrates all prefill on half the engines; measured
#     in results/pd.md).
#   KV_BLOCKS=65536 × 16 tokens per engine, MAX_RUNNING=64 (defaults: room for the trace's
#     prompts; the prefix cache holds the conversations' shared prefixes).
#
# Usage: bench/pd.sh   (≈ 12 min on 2 cores plus the build; builds target/release/tokengate
#   first, BUILD=0 skips)
# Knobs (environment): SEEDS ("1 2 3"), CONFIGS, ENGINES (4), PREFILLS (2), DECODES (2),
#   TRACE, LIMIT (300), WINDOW (1500), TIME_SCALE (2.2), DURATION (50 s of sending), DRAIN
#   (25 s), SIM_TIME_SCALE, PREFILL_TPS, DECODE_STEP_MS, DECODE_PER_REQ_MS, PREFILL_CHUNK,
#   KV_TRANSFER_MS, KV_BLOCKS, MAX_RUNNING, SMG_PROBE (1), OUT (target/bench/pd: git-ignored),
#   MD (bench/results/pd.md), TABLE_ONLY=1 (rewrite MD from OUT without running anything).
# The text after "<!-- discussion -->" in the existing MD is kept when it is rewritten.
# Needs: cargo, python3, curl; smg (pip install smg) for smg-* configs.
# Writes: MD, OUT/{flags.txt,build.txt,command.txt,wall_s.txt,smg-cli-probe.txt} and per run
#   OUT/s<seed>/<config>/{report.json,report.md,engines.json,load.txt,wall_s.txt,replay.log;
#   tokengate: gateway.yaml,gateway.metrics.txt,instances.json,gateway.log.errors;
#   smg: router.txt,workers.json,smg.log.tail}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SEEDS=${SEEDS:-"1 2 3"}
CONFIGS=${CONFIGS:-"tg-integrated tg-pd-sglang tg-pd-vllm smg-pd"}
ENGINES=${ENGINES:-4}
PREFILLS=${PREFILLS:-2}
DECODES=${DECODES:-2}
TRACE=${TRACE:-$ROOT/../shared/traces/mooncake_conversation_trace.jsonl}
[ -f "$TRACE" ] || TRACE=/work/shared/traces/mooncake_conversation_trace.jsonl
LIMIT=${LIMIT:-300}
WINDOW=${WINDOW:-1500}
TIME_SCALE=${TIME_SCALE:-2.2}
DURATION=${DURATION:-50}
DRAIN=${DRAIN:-25}
SIM_TIME_SCALE=${SIM_TIME_SCALE:-3.3}
PREFILL_TPS=${PREFILL_TPS:-16000}
DECODE_STEP_MS=${DECODE_STEP_MS:-10}
DECODE_PER_REQ_MS=${DECODE_PER_REQ_MS:-0.3}
PREFILL_CHUNK=${PREFILL_CHUNK:-2048}
KV_TRANSFER_MS=${KV_TRANSFER_MS:-10}
KV_BLOCKS=${KV_BLOCKS:-65536}
MAX_RUNNING=${MAX_RUNNING:-64}
SMG_PROBE=${SMG_PROBE:-1}
OUT=${OUT:-target/bench/pd}
MD=${MD:-bench/results/pd.md}
BLOCK_SIZE=16 # engine-sim KV block (tokens) = the gateway's prefix_index.block_size
MODEL=qwen3-0.6b

uses_smg=0
for c in $CONFIGS; do
  case $c in
    tg-integrated|tg-pd-sglang|tg-pd-vllm) ;;
    smg-pd|smg-integrated) uses_smg=1;;
    *) echo "unknown config '$c'" >&2; exit 1;;
  esac
done
if [ -z "${TABLE_ONLY:-}" ] && [ $uses_smg = 1 ]; then
  command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; }
fi
[ "$((PREFILLS + DECODES))" = "$ENGINES" ] || echo "note: PREFILLS + DECODES != ENGINES" >&2
command -v python3 >/dev/null || { echo "python3 missing" >&2; exit 1; }
[ -n "${TABLE_ONLY:-}" ] || [ -f "$TRACE" ] || { echo "no trace at $TRACE (set TRACE)" >&2; exit 1; }

. bench/lib.sh

T0=$(date +%s)
BIN=$ROOT/target/release/tokengate
SIM_FLAGS="--time-scale $SIM_TIME_SCALE --kv-blocks $KV_BLOCKS --block-size $BLOCK_SIZE --max-running $MAX_RUNNING --prefill-tps $PREFILL_TPS --decode-step-ms $DECODE_STEP_MS --decode-per-req-ms $DECODE_PER_REQ_MS --prefill-chunk-tokens $PREFILL_CHUNK"
PD_SIM_FLAGS="--kv-transfer-ms-per-1k-tokens $KV_TRANSFER_MS --pd-timeout-ms 60000"
WL_FLAGS="--trace $TRACE --limit $LIMIT --time-scale $TIME_SCALE --duration ${DURATION}s --drain-timeout ${DRAIN}s"

if [ -z "${TABLE_ONLY:-}" ]; then
  if [ "${BUILD:-1}" = 1 ]; then
    ./scripts/setup.sh
    cargo build --release --bin tokengate --quiet
  fi
  [ -x "$BIN" ] || { echo "no $BIN (run without BUILD=0)" >&2; exit 1; }
  mkdir -p "$OUT"
  printf 'sim: %s\npd sim: %s\nworkload: %s\n' "$SIM_FLAGS" "$PD_SIM_FLAGS" "$WL_FLAGS" >"$OUT/flags.txt"
  { git rev-parse --short HEAD; git status --porcelain -- . ':!bench/results' | head -1; } >"$OUT/build.txt" 2>/dev/null || true
fi

# What else runs on the machine: the 1-min load average and other benchmark processes.
machine_load() {
  local others
  others=$(pgrep -fa 'bench/(tail|compare|overhead|load|k6|throttling)\.sh|cargo (test|build|bench|clippy)' | grep -v "^$$ " | sed -E 's/^[0-9]+ //' | cut -c1-60 | sort | uniq -c | tr -s ' ' | paste -sd';' - || true)
  echo "$(cut -d' ' -f1 /proc/loadavg) ${others:-none}"
}

# smg's worker specs for the PD fleet (POST /workers): engine-sim answers both vLLM's and
# SGLang's probe endpoints, so the runtime is named explicitly.
smg_pd_specs() {
  local k
  SMG_REGISTER=()
  for k in "${!PREFILL_URLS[@]}"; do
    SMG_REGISTER+=("{\"url\":\"${PREFILL_URLS[$k]}\",\"worker_type\":\"prefill\",\"bootstrap_port\":${PREFILL_BOOTSTRAP[$k]},\"runtime_type\":\"sglang\"}")
  done
  for k in "${!DECODE_URLS[@]}"; do
    SMG_REGISTER+=("{\"url\":\"${DECODE_URLS[$k]}\",\"worker_type\":\"decode\",\"runtime_type\":\"sglang\"}")
  done
}

# smg started the documented way, workers on the command line: which runtime it detects for
# engine-sim and what one request gets back. Writes OUT/smg-cli-probe.txt.
smg_cli_probe() {
  local f=$OUT/smg-cli-probe.txt args=(--pd-disaggregation) k code
  echo "== smg command-line probe" >&2
  start_pd_fleet sglang
  for k in "${!PREFILL_URLS[@]}"; do args+=(--prefill "${PREFILL_URLS[$k]}" "${PREFILL_BOOTSTRAP[$k]}"); done
  for k in "${!DECODE_URLS[@]}"; do args+=(--decode "${DECODE_URLS[$k]}"); done
  {
    echo "smg: $(smg --version 2>&1 | head -1)"
    echo "command: smg launch ${args[*]} --policy cache_aware"
  } >"$f"
  SMG_REGISTER=()
  if ! SMG_LOG_LEVEL=debug start_smg cache_aware "${args[@]}" 2>>"$f"; then
    echo "outcome: smg did not start" >>"$f"
    stop "${SMG_PID:-}" "${ENGINE_PIDS[@]}"
    return 0
  fi
  {
    echo "workers (GET /workers): $(curl -sf "$SMG_URL/workers" | python3 -c 'import json,sys; print("; ".join(w["worker_type"] + " " + w["url"] + " runtime_type=" + str(w.get("runtime_type")) for w in json.load(sys.stdin)["workers"]))' 2>&1)"
    echo "smg log, backend detection:"
    sed 's/\x1b\[[0-9;]*m//g' "$WORK/smg.log" | grep -E 'Detected (HTTP )?backend' | sed -E 's/^[0-9-]+ [0-9:]+ +//; s/^/  /' | head -4
    code=$(curl -s -o "$WORK/probe.body" -w '%{http_code}' "$SMG_URL/v1/chat/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":4}")
    echo "request: POST /v1/chat/completions (max_tokens 4, not streamed) -> HTTP $code $(head -c 400 "$WORK/probe.body")"
    echo "smg log, errors:"
    sed 's/\x1b\[[0-9;]*m//g' "$WORK/smg.log" | grep -E ' ERROR ' | sed -E 's/^[0-9-]+ [0-9:]+ +//; s/^/  /' | head -2
    echo "prefill engines: $(for u in "${PREFILL_URLS[@]}"; do curl -sf "$u/admin/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print("finished", s["requests_finished"], "published", s["pd_prefills_published"], end="; ")'; done)"
    echo "decode engines: $(for u in "${DECODE_URLS[@]}"; do curl -sf "$u/admin/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print("finished", s["requests_finished"], "KV received", s["pd_transfers_received"], end="; ")'; done)"
  } >>"$f" 2>&1
  stop "$SMG_PID" "${ENGINE_PIDS[@]}"
  sed 's/^/   /' "$f" >&2
}

run_one() { # $1 = seed, $2 = config
  local seed=$1 name=$2 t1; t1=$(date +%s)
  local dir=$OUT/s$seed/$name
  rm -rf "$dir"; mkdir -p "$dir"
  echo "== seed $seed: $name" >&2
  echo "before: $(machine_load)" >"$dir/load.txt"
  local kind=tg target=() smg_args=()
  case $name in
    tg-integrated)
      start_fleet
      start_tokengate '    scheduler: { mode: layered }';;
    tg-pd-sglang)
      start_pd_fleet sglang
      start_tokengate $'    scheduler: { mode: layered }\n    pd: { mode: sglang-mooncake, decode_policy: least-token }' "$(pd_instances_yaml)";;
    tg-pd-vllm)
      start_pd_fleet vllm
      start_tokengate $'    scheduler: { mode: layered }\n    pd: { mode: vllm-nixl, decode_policy: least-token }' "$(pd_instances_yaml)";;
    smg-pd|smg-integrated)
      kind=smg
      if [ "$name" = smg-pd ]; then
        start_pd_fleet sglang
        smg_pd_specs
        echo "$(smg --version 2>&1 | head -1): smg launch --pd-disaggregation --policy cache_aware, then POST /workers for each engine (runtime_type sglang)" >"$dir/router.txt"
        printf '  %s\n' "${SMG_REGISTER[@]}" >>"$dir/router.txt"
        smg_args=(--pd-disaggregation)
      else
        start_fleet
        SMG_REGISTER=()
        echo "$(smg --version 2>&1 | head -1): smg launch --worker-urls <the ${#ENGINE_URLS[@]} engines> --policy cache_aware" >"$dir/router.txt"
        printf '  %s\n' "${ENGINE_URLS[@]}" >>"$dir/router.txt"
      fi
      if ! start_smg cache_aware "${smg_args[@]}" 2>"$dir/smg-start.err"; then
        echo "   smg did not start: see $dir/smg-start.err" >&2
        stop "${SMG_PID:-}" "${ENGINE_PIDS[@]}"
        echo "smg did not start" >"$dir/skipped.txt"
        return 0
      fi
      rm -f "$dir/smg-start.err";;
  esac
  if [ "$kind" = tg ]; then
    cp "$WORK/gw.yaml" "$dir/gateway.yaml"
    target=(--url "$GW_URL")
  else
    target=(--url "$SMG_URL")
  fi
  # shellcheck disable=SC2086 # WL_FLAGS is a list of flags
  timeout -k 5 $((DURATION + DRAIN + 60)) "$BIN" bench replay --model "$MODEL" "${target[@]}" \
    $WL_FLAGS --skip $(((seed - 1) * WINDOW)) --seed "$seed" \
    --out-json "$dir/report.json" --out-md "$dir/report.md" \
    >/dev/null 2>"$dir/replay.log" || echo "   replay failed (exit $?), see $dir/replay.log" >&2
  if [ "$kind" = tg ]; then
    sleep 0.5 # let the last usage records land
    curl -sf "$GW_ADMIN/metrics" | grep -E '^tokengate_(pd_|prefix_hit_ratio|routing_decisions|requests_total|upstream_errors|retries)' >"$dir/gateway.metrics.txt" || true
    curl -sf "$GW_ADMIN/admin/instances" >"$dir/instances.json" || true
    grep -iE 'error|panic' "$WORK/gw.log" | head -20 >"$dir/gateway.log.errors" || true
    stop "$GW_PID"
  else
    curl -sf "$SMG_URL/workers" >"$dir/workers.json" || true
    tail -n 50 "$WORK/smg.log" >"$dir/smg.log.tail"
    stop "$SMG_PID"
  fi
  # each engine's own view: prompt / cached / computed tokens, PD transfers, peak batch, steps
  local k
  {
    echo "{"
    for k in "${!ENGINE_IDS[@]}"; do
      printf '"%s": %s%s\n' "${ENGINE_IDS[$k]}" "$(curl -sf "${ENGINE_URLS[$k]}/admin/stats" || echo null)" "$([ "$k" -lt $((${#ENGINE_IDS[@]} - 1)) ] && echo ,)"
    done
    echo "}"
  } >"$dir/engines.json"
  stop "${ENGINE_PIDS[@]}"
  echo "after: $(machine_load)" >>"$dir/load.txt"
  echo "$(( $(date +%s) - t1 ))" >"$dir/wall_s.txt"
  python3 - "$dir" <<'PY' >&2
import json, os, sys
d = sys.argv[1]
if not os.path.exists(os.path.join(d, "report.json")):
    print("   no report"); sys.exit(0)
r = json.load(open(os.path.join(d, "report.json"))); c = r["counts"]
print("   ok %d/%d, TTFT p50 %.0f p99 %.0f, TPOT p50 %.1f p99 %.1f, e2e p50 %.0f p99 %.0f ms, lag p99 %.0f ms, %s s" % (
    c["ok"], c["sent"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["tpot_ms"]["p99"],
    r["e2e_ms"]["p50"], r["e2e_ms"]["p99"], r["dispatch_lag_ms"]["p99"], open(os.path.join(d, "wall_s.txt")).read().strip()))
PY
}

if [ -z "${TABLE_ONLY:-}" ]; then
  if [ $uses_smg = 1 ] && [ "$SMG_PROBE" = 1 ]; then smg_cli_probe; fi
  for seed in $SEEDS; do
    for c in $CONFIGS; do run_one "$seed" "$c"; done
  done
fi
CMD=""
for v in SEEDS CONFIGS ENGINES PREFILLS DECODES LIMIT WINDOW TIME_SCALE DURATION DRAIN SIM_TIME_SCALE PREFILL_TPS DECODE_STEP_MS DECODE_PER_REQ_MS PREFILL_CHUNK KV_TRANSFER_MS KV_BLOCKS MAX_RUNNING; do
  case "${!v}" in *' '*) CMD="$CMD$v=\"${!v}\" ";; *) CMD="$CMD$v=${!v} ";; esac
done
[ "$OUT" = target/bench/pd ] || CMD="${CMD}OUT=$OUT "
[ "$MD" = bench/results/pd.md ] || CMD="${CMD}MD=$MD "
CMD="${CMD}bench/pd.sh"
if [ -z "${TABLE_ONLY:-}" ]; then
  printf '%s\n' "$CMD" >"$OUT/command.txt"
  echo "$(( $(date +%s) - T0 ))" >"$OUT/wall_s.txt"
else
  [ -f "$OUT/command.txt" ] && CMD=$(cat "$OUT/command.txt")
fi
CMD=$CMD python3 bench/pd_report.py "$OUT" "$MD" "$SEEDS" "$CONFIGS"
echo "wrote $MD" >&2
