#!/usr/bin/env bash
# Gateway overhead, side by side in one run: the direct path to a fast upstream, tokengate in front
# of it, and the SGLang model gateway (smg) in front of it.
#   latency: 1 connection, N requests -> p50 / p99
#   throughput: 32 connections for D seconds -> requests/s
# Upstream: one engine-sim with --time-scale 1e6 (prefill and decode take ~0), 1 output token.
# Body: a 2 KB chat completion request.
#
# Usage: bench/overhead.sh [N_LATENCY=20000] [DURATION=15s]
# Needs: oha (cargo install oha), smg (pip install smg). Writes bench/results/overhead.md.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
DUR=${2:-15s}
OUT=bench/results/overhead.md
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

command -v oha >/dev/null || { echo "oha missing: cargo install oha" >&2; exit 1; }
command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; }
./scripts/setup.sh
cargo build --release --quiet
BIN=target/release/tokengate

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 200); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not ready: $1" >&2; exit 1; }

UP_PORT=$(free_port)
$BIN engine-sim --listen 127.0.0.1:$UP_PORT --id up --model bench-model --time-scale 1000000 \
  --default-output-tokens 1 --max-running 1024 >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:$UP_PORT/health

GW_PORT=$(free_port); ADM_PORT=$(free_port)
cat >"$WORK/gw.yaml" <<YAML
listen: ["127.0.0.1:$GW_PORT"]
admin_listen: "127.0.0.1:$ADM_PORT"
threads: 2
services:
  - name: bench-model
    load_balancing: least-token
    instances:
      - { id: up, addr: "127.0.0.1:$UP_PORT" }
YAML
start_gw() { # $1 = RUST_LOG
  RUST_LOG=$1 $BIN serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
  GW_PID=$!; PIDS+=($GW_PID)
  wait_http http://127.0.0.1:$ADM_PORT/health
}

SMG_PORT=$(free_port)
smg launch --worker-urls http://127.0.0.1:$UP_PORT --policy round_robin --host 127.0.0.1 \
  --port $SMG_PORT --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
  --log-level warn >"$WORK/smg.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:$SMG_PORT/health

python3 - "$WORK/body.json" <<'PY'
import json, sys
msg = "You are a helpful assistant. " * 8
body = {"model": "bench-model", "max_tokens": 1, "messages": [
    {"role": "system", "content": msg},
    {"role": "user", "content": "x" * (2048 - 60 - len(json.dumps(msg)))}]}
s = json.dumps(body)
open(sys.argv[1], "w").write(s)
print("body bytes:", len(s))
PY

run() { # $1 name, $2 url, $3.. oha args
  local name=$1 url=$2; shift 2
  oha --no-tui --output-format json -m POST -H 'content-type: application/json' \
    -D "$WORK/body.json" "$@" "$url" >"$WORK/$name.json"
}
TARGETS=(direct tokengate tokengate-accesslog smg)
url_of() {
  case $1 in
    direct) echo "http://127.0.0.1:$UP_PORT/v1/chat/completions";;
    tokengate|tokengate-accesslog) echo "http://127.0.0.1:$GW_PORT/v1/chat/completions";;
    smg) echo "http://127.0.0.1:$SMG_PORT/v1/chat/completions";;
  esac
}
for t in "${TARGETS[@]}"; do
  case $t in
    tokengate) start_gw warn;;
    tokengate-accesslog) kill $GW_PID; wait $GW_PID 2>/dev/null || true; start_gw info;;
  esac
  u=$(url_of $t)
  run "$t-warm" "$u" -n 2000 -c 8
  run "$t-lat" "$u" -n "$N" -c 1
  run "$t-tput" "$u" -z "$DUR" -c 32
done

python3 - "$WORK" "$OUT" "$N" "$DUR" <<'PY'
import json, sys, os, platform, subprocess, datetime
work, out, n, dur = sys.argv[1:5]
def load(name):
    return json.load(open(os.path.join(work, name + ".json")))
rows = []
base = None
for t in ["direct", "tokengate", "tokengate-accesslog", "smg"]:
    lat = load(t + "-lat"); tp = load(t + "-tput")
    p50 = lat["latencyPercentiles"]["p50"] * 1e6
    p99 = lat["latencyPercentiles"]["p99"] * 1e6
    rps = tp["summary"]["requestsPerSec"]
    ok = tp["summary"]["successRate"]
    if base is None: base = (p50, p99)
    rows.append((t, p50, p99, p50 - base[0], p99 - base[1], rps, ok))
tg = next(r for r in rows if r[0] == "tokengate"); sm = next(r for r in rows if r[0] == "smg")
cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
ver = subprocess.run(["target/release/tokengate", "--version"], capture_output=True, text=True).stdout.strip()
smgv = subprocess.run(["pip", "show", "smg"], capture_output=True, text=True).stdout
smgv = next((l.split(":",1)[1].strip() for l in smgv.splitlines() if l.startswith("Version")), "?")
with open(out, "w") as f:
    f.write("# Gateway overhead\n\n")
    f.write(f"Run {datetime.datetime.utcnow().isoformat(timespec='seconds')}Z on {os.cpu_count()} cores ({cpu}), {platform.platform()}; "
            f"{ver}, smg {smgv}, oha. Command: `bench/overhead.sh {n} {dur}`.\n\n")
    f.write("Upstream: one engine-sim (`--time-scale 1000000`, 1 output token, non-streaming). Body: 2 KB chat request. "
            "Everything (load generator, gateways, upstream) shares the same 2 cores, so throughput is CPU-bound for all.\n\n")
    f.write(f"| path | p50 µs (1 conn, {n} req) | p99 µs | added p50 µs | added p99 µs | req/s (32 conn, {dur}) | success |\n|---|---|---|---|---|---|---|\n")
    for r in rows:
        f.write(f"| {r[0]} | {r[1]:.0f} | {r[2]:.0f} | {r[3]:+.0f} | {r[4]:+.0f} | {r[5]:.0f} | {r[6]*100:.1f} % |\n")
    f.write(f"\ntokengate (access log off) adds **{tg[3]:.0f} µs** at p50 (target ≤ 60 µs); "
            f"throughput **{tg[5]/sm[5]:.2f}×** smg's (target ≥ 2.5×).\n")
    f.write("`tokengate-accesslog` is the same gateway with the default `RUST_LOG=info` (one access-log line per request to stderr).\n")
print(open(out).read())
PY
