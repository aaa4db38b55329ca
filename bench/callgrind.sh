#!/usr/bin/env bash
# User-space instructions per proxied request, counted by callgrind: repeatable for the same
# binary and inputs whatever else the machine does (a 2-core VM's wall clock is not). Compare
# builds side by side in one run.
#
# Each binary runs under `valgrind --tool=callgrind` as `tokengate serve` in front of one
# engine-sim (--time-scale 1e6: prefill and decode take ~0; 1 output token); a client sends
# WARM requests, the counters are zeroed (callgrind_control -z), N requests are sent over 4
# keep-alive connections, the counters are dumped and divided by N. The body is the 2 KB chat
# request of bench/overhead.sh; SCHED picks the service's scheduler (balance, layered, policy).
# TENANTS=1: the config has 50 tenants (one key each, models by prefix, all four limits, high
# enough never to refuse) and the client sends the last tenant's key: the cost of the key
# lookup, the model check, the limits and their headers, and the tenant's accounting.
# TENANTS=2: the same with only `concurrency` (no per-minute limit: no x-ratelimit headers).
#
# Usage: [SCHED=balance] [TENANTS=0] [N=1000] [WARM=200] [TRACING=RATIO] [SIM_BIN=BIN] bench/callgrind.sh [BIN ...]
#   (default: target/dist/tokengate). TRACING=1.0 adds a `tracing:` block (that sample ratio)
#   exporting to a local OTLP/HTTP sink that answers 200 and drops the spans. SIM_BIN: the
#   binary that runs engine-sim (default: the first BIN; a --no-default-features build has none).
# Needs valgrind (apt-get install valgrind). Prints one line per binary; with OUT=FILE appends
# a markdown table row per binary to FILE; with KEEP=DIR keeps the dumps there (read them with
# `callgrind_annotate --inclusive=yes FILE`).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
N=${N:-1000}
WARM=${WARM:-200}
SCHED=${SCHED:-balance}
BINS=("$@")
[ ${#BINS[@]} -gt 0 ] || BINS=(target/dist/tokengate)
command -v valgrind >/dev/null || { echo "valgrind missing: apt-get install valgrind" >&2; exit 1; }
SIM_BIN=${SIM_BIN:-${BINS[0]}}
TRACING_YAML=""
if [ -n "${TRACING:-}" ]; then
  SINK_PORT=$(free_port)
  python3 - "$SINK_PORT" <<'PY' >"$WORK/sink.log" 2>&1 &
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
  PIDS+=($!)
  TRACING_YAML=$'tracing:\n  otlp: {endpoint: "http://127.0.0.1:'"$SINK_PORT"$'"}\n  sample_ratio: '"$TRACING"$'\n'
fi

UP_PORT=$(free_port)
$SIM_BIN engine-sim --listen 127.0.0.1:$UP_PORT --id up --model bench-model --time-scale 1000000 \
  --default-output-tokens 1 --max-running 1024 >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:$UP_PORT/health

case "$SCHED" in
  balance) SCHED_YAML="" ;;
  layered) SCHED_YAML=$'    scheduler:\n      mode: layered\n      affinity: {}\n      prefix: {}\n' ;;
  policy) SCHED_YAML=$'    scheduler:\n      mode: policy\n      plugins: [{kind: session-affinity}, {kind: least-inflight}, {kind: prefix-cache}]\n' ;;
  *) echo "SCHED: balance, layered or policy" >&2; exit 1 ;;
esac

TENANTS=${TENANTS:-0}
TENANTS_YAML="" AUTH=""
if [ "$TENANTS" != 0 ]; then
  LIMITS="requests_per_minute: 100000000, input_tokens_per_minute: 100000000000, output_tokens_per_minute: 100000000000, concurrency: 100000"
  [ "$TENANTS" = 2 ] && LIMITS="concurrency: 100000"
  TENANTS_YAML="tenants:"$'\n'
  for i in $(seq 1 50); do
    TENANTS_YAML+="  - {name: t$i, keys: [sk-bench-$i], models: [\"bench-*\"], limits: {$LIMITS}}"$'\n'
  done
  AUTH="Bearer sk-bench-50"
fi

python3 - "$WORK/body.json" <<'PY'
import json, sys
msg = "You are a helpful assistant. " * 8
body = {"model": "bench-model", "max_tokens": 1, "messages": [
    {"role": "system", "content": msg},
    {"role": "user", "content": "x" * (2048 - 60 - len(json.dumps(msg)))}]}
open(sys.argv[1], "w").write(json.dumps(body))
PY

send() { # $1 port, $2 requests
  python3 - "$1" "$2" "$WORK/body.json" "$AUTH" <<'PY'
import http.client, sys, threading
port, n, body = int(sys.argv[1]), int(sys.argv[2]), open(sys.argv[3], "rb").read()
headers = {"content-type": "application/json"}
if sys.argv[4]:
    headers["authorization"] = sys.argv[4]
errors = []
def worker(k):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for _ in range(k):
        c.request("POST", "/v1/chat/completions", body, headers)
        r = c.getresponse(); r.read()
        if r.status != 200: errors.append(r.status)
conns = 4
ts = [threading.Thread(target=worker, args=(n // conns + (1 if i < n % conns else 0),)) for i in range(conns)]
[t.start() for t in ts]; [t.join() for t in ts]
if errors: sys.exit(f"{len(errors)} errors: {errors[:5]}")
PY
}

for BIN in "${BINS[@]}"; do
  port=$(free_port); adm=$(free_port)
  cat >"$WORK/tg.yaml" <<YAML
listen: ["127.0.0.1:$port"]
admin_listen: "127.0.0.1:$adm"
threads: 2
health_check: {enabled: false}
${TENANTS_YAML}services:
  - name: bench-model
${SCHED_YAML}    instances:
      - { id: up, addr: "127.0.0.1:$UP_PORT" }
${TRACING_YAML}
YAML
  RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.%p" \
    "$BIN" serve -c "$WORK/tg.yaml" >"$WORK/tg.out" 2>"$WORK/tg.log" &
  vpid=$!
  for _ in $(seq 1 600); do curl -sf -o /dev/null "http://127.0.0.1:$adm/health" && break; sleep 0.1; done
  send "$port" "$WARM"
  callgrind_control -z "$vpid" >/dev/null
  send "$port" "$N"
  callgrind_control -d "$vpid" >/dev/null
  kill "$vpid"; wait "$vpid" 2>/dev/null || true
  # The dump after zeroing: the last numbered dump file of this pid.
  dump=$(ls -t "$WORK"/cg."$vpid".* | head -1)
  ir=$(grep -m1 '^summary:' "$dump" | awk '{print $2}')
  per=$(python3 -c "print(f'{$ir / $N:,.0f}')")
  echo "$BIN sched=$SCHED tenants=$TENANTS${TRACING:+ tracing=$TRACING}: $per instructions per request ($ir over $N)"
  if [ -n "${KEEP:-}" ]; then
    mkdir -p "$KEEP"; cp "$dump" "$KEEP/callgrind.$(basename "$BIN").$SCHED"
  fi
  if [ -n "${OUT:-}" ]; then
    echo "| \`$BIN\` | $SCHED | $N | $per |" >>"$OUT"
  fi
  rm -f "$WORK"/cg."$vpid"*
done
