#!/usr/bin/env bash
# Gateway overhead, side by side in one run: the direct path to a fast upstream, tokengate in front
# of it, the SGLang model gateway (smg) in front of it, and two references that tell the gateway's
# own cost from the machine's: a bare Pingora proxy (examples/bare_pingora.rs: forwards, nothing
# else; the floor tokengate stands on) and nginx (when installed).
#   latency:    1 connection, N requests -> p50 / p99
#   throughput: 32 connections for D seconds -> requests/s, and the proxy's CPU time per request
# The targets are measured in ROUNDS interleaved rounds (the order rotates each round) and the
# table reports medians: on a shared 2-core VM one pass per target is not enough to tell a 10 %
# difference from the neighbours' noise. The ratio tokengate/smg is taken within each round.
# Upstream: one engine-sim with --time-scale 1e6 (prefill and decode take ~0), 1 output token.
# Body: a 2 KB chat completion request.
#
# PIN=1 gives each proxy a core of its own: the proxy under test runs on CPU 1 with one worker
# (tokengate `threads: 1`, bare Pingora 1 thread, nginx 1 worker, smg sees one CPU), oha and the
# upstream on CPU 0. Without it (the default) everything shares both cores, and the fixed cost of
# the load generator and the upstream (~67 us of CPU per request here) dilutes every ratio.
#
# Usage: [PIN=1] bench/overhead.sh [N_LATENCY=5000] [DURATION=8s] [ROUNDS=5]
# Needs: oha (cargo install oha), smg (pip install smg); optional: nginx (apt-get install nginx-light).
# Writes bench/results/overhead.md and overhead.json (PIN=1: overhead-pinned.md / .json).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-5000}
DUR=${2:-8s}
ROUNDS=${3:-5}
PIN=${PIN:-0}
OUT=bench/results/overhead.md
LOAD=() PROXY=() THREADS=2
if [ "$PIN" = 1 ]; then
  [ "$(nproc)" -ge 2 ] || { echo "PIN=1 needs at least 2 CPUs" >&2; exit 1; }
  OUT=bench/results/overhead-pinned.md
  LOAD=(taskset -c 0) PROXY=(taskset -c 1) THREADS=1
fi
. bench/lib.sh
cleanup_extra() { [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")"; }

command -v oha >/dev/null || { echo "oha missing: cargo install oha" >&2; exit 1; }
command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; }
./scripts/setup.sh
cargo build --profile dist --quiet --bin tokengate --example bare_pingora
BIN=target/dist/tokengate


UP_PORT=$(free_port)
"${LOAD[@]}" $BIN engine-sim --listen 127.0.0.1:$UP_PORT --id up --model bench-model --time-scale 1000000 \
  --default-output-tokens 1 --max-running 1024 >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:$UP_PORT/health

declare -A URL PID
URL[direct]=http://127.0.0.1:$UP_PORT/v1/chat/completions

# tokengate twice: access log off (RUST_LOG=warn) and on (the default RUST_LOG=info, to stderr).
start_tg() { # $1 name, $2 RUST_LOG
  local port adm
  port=$(free_port); adm=$(free_port)
  cat >"$WORK/$1.yaml" <<YAML
listen: ["127.0.0.1:$port"]
admin_listen: "127.0.0.1:$adm"
threads: $THREADS
services:
  - name: bench-model
    load_balancing: least-token
    instances:
      - { id: up, addr: "127.0.0.1:$UP_PORT" }
YAML
  RUST_LOG=$2 "${PROXY[@]}" $BIN serve -c "$WORK/$1.yaml" >"$WORK/$1.out" 2>"$WORK/$1.log" &
  PID[$1]=$!; PIDS+=($!)
  wait_http http://127.0.0.1:$adm/health
  URL[$1]=http://127.0.0.1:$port/v1/chat/completions
}
start_tg tokengate warn
start_tg tokengate-accesslog info

BARE_PORT=$(free_port)
"${PROXY[@]}" target/dist/examples/bare_pingora 127.0.0.1:$BARE_PORT 127.0.0.1:$UP_PORT $THREADS >"$WORK/bare.log" 2>&1 &
PID[bare-pingora]=$!; PIDS+=($!)
URL[bare-pingora]=http://127.0.0.1:$BARE_PORT/v1/chat/completions
for _ in $(seq 1 100); do curl -s -o /dev/null "${URL[bare-pingora]}" && break; sleep 0.1; done

SMG_PORT=$(free_port)
"${PROXY[@]}" smg launch --worker-urls http://127.0.0.1:$UP_PORT --policy round_robin --host 127.0.0.1 \
  --port $SMG_PORT --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
  --log-level warn >"$WORK/smg.log" 2>&1 &
PID[smg]=$!; PIDS+=($!)
wait_http http://127.0.0.1:$SMG_PORT/health
URL[smg]=http://127.0.0.1:$SMG_PORT/v1/chat/completions

TARGETS=(direct tokengate tokengate-accesslog bare-pingora smg)
if command -v nginx >/dev/null; then
  NG_PORT=$(free_port)
  cat >"$WORK/nginx.conf" <<NGINX
worker_processes $THREADS;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK; proxy_temp_path $WORK; fastcgi_temp_path $WORK;
  uwsgi_temp_path $WORK; scgi_temp_path $WORK;
  upstream up { server 127.0.0.1:$UP_PORT; keepalive 64; }
  server {
    listen 127.0.0.1:$NG_PORT;
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }
  }
}
NGINX
  "${PROXY[@]}" nginx -c "$WORK/nginx.conf"
  for _ in $(seq 1 50); do [ -s "$WORK/nginx.pid" ] && break; sleep 0.1; done
  PID[nginx]=$(cat "$WORK/nginx.pid")
  URL[nginx]=http://127.0.0.1:$NG_PORT/v1/chat/completions
  TARGETS+=(nginx)
else
  echo "nginx not installed: the nginx reference row is skipped (apt-get install nginx-light)" >&2
fi
PID[direct]=${PIDS[0]}

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

# CPU ticks (utime + stime) of a process and all its descendants.
cpu_ticks() {
  python3 - "$1" <<'PY'
import os, sys
root = int(sys.argv[1]); kids = {}; ticks = {}
for p in os.listdir("/proc"):
    if not p.isdigit(): continue
    try:
        s = open(f"/proc/{p}/stat").read()
    except OSError:
        continue
    f = s[s.rindex(")") + 2:].split()
    kids.setdefault(int(f[1]), []).append(int(p)); ticks[int(p)] = int(f[11]) + int(f[12])
tot, todo = 0, [root]
while todo:
    p = todo.pop(); tot += ticks.get(p, 0); todo += kids.get(p, [])
print(tot)
PY
}

oha_run() { # $1 out, $2 url, $3.. oha args
  local out=$1 url=$2; shift 2
  "${LOAD[@]}" oha --no-tui --output-format json -m POST -H 'content-type: application/json' \
    -D "$WORK/body.json" "$@" "$url" >"$out"
}

for r in $(seq 1 "$ROUNDS"); do
  n=${#TARGETS[@]}
  for i in $(seq 0 $((n - 1))); do
    t=${TARGETS[$(((i + r - 1) % n))]}
    u=${URL[$t]}
    oha_run "$WORK/warm.json" "$u" -n 1000 -c 8
    oha_run "$WORK/$t-lat-$r.json" "$u" -n "$N" -c 1
    c0=$(cpu_ticks "${PID[$t]}")
    oha_run "$WORK/$t-tput-$r.json" "$u" -z "$DUR" -c 32
    c1=$(cpu_ticks "${PID[$t]}")
    echo $((c1 - c0)) >"$WORK/$t-cpu-$r.txt"
    echo "round $r/$ROUNDS: $t done" >&2
  done
done

python3 - "$WORK" "$OUT" "$N" "$DUR" "$ROUNDS" "$(getconf CLK_TCK)" "$PIN" "${TARGETS[@]}" <<'PY'
import json, sys, os, platform, subprocess, datetime, statistics as st
work, out, n, dur, rounds, tck, pin = sys.argv[1:8]
targets = sys.argv[8:]
pinned = pin == "1"
rounds, tck = int(rounds), int(tck)
def load(t, kind, r):
    return json.load(open(os.path.join(work, f"{t}-{kind}-{r}.json")))
res = {t: [] for t in targets}
for t in targets:
    for r in range(1, rounds + 1):
        lat, tp = load(t, "lat", r), load(t, "tput", r)
        ticks = int(open(os.path.join(work, f"{t}-cpu-{r}.txt")).read())
        reqs = sum(tp.get("statusCodeDistribution", {}).values()) or tp["summary"]["requestsPerSec"] * tp["summary"]["total"]
        res[t].append(dict(
            p50=lat["latencyPercentiles"]["p50"] * 1e6, p99=lat["latencyPercentiles"]["p99"] * 1e6,
            rps=tp["summary"]["requestsPerSec"], ok=tp["summary"]["successRate"],
            cpu_us=ticks / tck / max(reqs, 1) * 1e6))
med = lambda xs: st.median(xs)
def added(t, k):
    return [a[k] - d[k] for a, d in zip(res[t], res["direct"])]
ratio = [a["rps"] / s["rps"] for a, s in zip(res["tokengate"], res["smg"])]
cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
ver = subprocess.run(["target/dist/tokengate", "--version"], capture_output=True, text=True).stdout.strip()
smgv = subprocess.run(["pip", "show", "smg"], capture_output=True, text=True).stdout
smgv = next((l.split(":", 1)[1].strip() for l in smgv.splitlines() if l.startswith("Version")), "?")
ngv = subprocess.run(["sh", "-c", "nginx -v 2>&1 | cut -d/ -f2"], capture_output=True, text=True).stdout.strip() or "-"
notes = {
    "direct": "oha → engine-sim (no proxy)",
    "tokengate": "access log off (`RUST_LOG=warn`)",
    "tokengate-accesslog": "default `RUST_LOG=info`: one access line per request to stderr",
    "bare-pingora": "`examples/bare_pingora.rs`: Pingora forwarding only, Pingora's own listener",
    "smg": "`smg launch --policy round_robin`",
    "nginx": f"nginx {ngv}, {1 if pinned else 2} worker(s), upstream keepalive, no buffering, no access log",
}
with open(out, "w") as f:
    f.write("# Gateway overhead\n\n")
    f.write(f"Run {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} on {os.cpu_count()} cores ({cpu}), "
            f"{platform.platform()}; {ver}, smg {smgv}, oha. Command: `{'PIN=1 ' if pinned else ''}bench/overhead.sh {n} {dur} {rounds}`.\n\n")
    if pinned:
        f.write("**Pinned**: each proxy runs alone on CPU 1 with one worker (tokengate `threads: 1`, bare Pingora 1 thread, "
                "nginx 1 worker, smg restricted to CPU 1 by `taskset`); oha and the engine-sim run on CPU 0. "
                "Throughput is then the proxy's own: one core's worth of its work per request.\n\n")
    else:
        f.write("**Shared**: load generator, upstream and proxy share both cores (each proxy with 2 workers).\n\n")
    f.write("Upstream: one engine-sim (`--time-scale 1000000`, 1 output token, non-streaming). Body: 2 KB chat request. "
            "Throughput is CPU-bound for all. "
            f"Each number is the **median of {rounds} interleaved rounds** (target order rotated per round); "
            "added latency is taken against the direct path of the same round. "
            "CPU/req is the proxy process tree's user+system time during the 32-connection run divided by the requests it served.\n\n")
    f.write(f"| path | p50 µs (1 conn, {n} req) | p99 µs | added p50 µs | added p99 µs | req/s (32 conn, {dur}) | CPU µs/req | success | what |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    for t in targets:
        rs = res[t]
        a50 = med(added(t, "p50")); a99 = med(added(t, "p99"))
        cpu_col = "-" if t == "direct" else f"{med([x['cpu_us'] for x in rs]):.0f}"
        f.write(f"| {t} | {med([x['p50'] for x in rs]):.0f} | {med([x['p99'] for x in rs]):.0f} | {a50:+.0f} | {a99:+.0f} | "
                f"{med([x['rps'] for x in rs]):.0f} | {cpu_col} | {min(x['ok'] for x in rs)*100:.1f} % | {notes.get(t, '')} |\n")
    tg_add = med(added("tokengate", "p50"))
    f.write(f"\ntokengate (access log off) adds **{tg_add:.0f} µs** at p50 (target ≤ 60 µs); "
            f"throughput **{med(ratio):.2f}×** smg's (median of the per-round ratios; range {min(ratio):.2f}–{max(ratio):.2f}×; target ≥ 2.5×).\n")
    if "bare-pingora" in res:
        bare_add = med(added("bare-pingora", "p50"))
        f.write(f"A bare Pingora proxy adds {bare_add:.0f} µs at p50 on the same machine: tokengate's own share of the added latency is "
                f"{tg_add - bare_add:+.0f} µs; its throughput is {med([a['rps']/b['rps'] for a, b in zip(res['tokengate'], res['bare-pingora'])]):.2f}× bare Pingora's.\n")
    f.write("\nPer round (req/s at 32 connections):\n\n| round | " + " | ".join(targets) + " |\n|---|" + "---|" * len(targets) + "\n")
    for r in range(rounds):
        f.write(f"| {r+1} | " + " | ".join(f"{res[t][r]['rps']:.0f}" for t in targets) + " |\n")
json.dump(dict(n=int(n), duration=dur, rounds=rounds, results=res), open(out.replace(".md", ".json"), "w"), indent=1)
print(open(out).read())
PY
