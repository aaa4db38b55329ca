#!/usr/bin/env bash
# The gateway's own cost per request, for comparing builds side by side in one run:
#   1. latency: p50 / p99 at 1 connection through each binary to a C upstream (nginx answering
#      `return 200` with a chat completion JSON: no tokio wake-ups hiding the proxy's cost),
#      the direct path and nginx as a proxy as references; wrk, ROUNDS interleaved rounds,
#      medians;
#   2. CPU: user-space instructions per request of each binary (bench/callgrind.sh).
#
# Usage: [ROUNDS=5] [DUR=5s] [SCHED=balance] bench/hotpath.sh BIN [BIN ...]
# Needs: nginx (apt-get install nginx-light), wrk (apt-get install wrk), valgrind.
# With OUT=FILE writes a markdown report there.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
ROUNDS=${ROUNDS:-5}
DUR=${DUR:-5s}
SCHED=${SCHED:-balance}
BINS=("$@")
[ ${#BINS[@]} -gt 0 ] || BINS=(target/dist/tokengate)
for c in nginx wrk valgrind; do command -v $c >/dev/null || { echo "$c missing" >&2; exit 1; }; done
cleanup_extra() { for f in "$WORK"/nginx*.pid; do [ -f "$f" ] && kill "$(cat "$f")"; done; }

python3 - "$WORK/body.json" "$WORK/post.lua" <<'PY'
import json, sys
msg = "You are a helpful assistant. " * 8
body = {"model": "bench-model", "max_tokens": 1, "messages": [
    {"role": "system", "content": msg},
    {"role": "user", "content": "x" * (2048 - 60 - len(json.dumps(msg)))}]}
s = json.dumps(body)
open(sys.argv[1], "w").write(s)
open(sys.argv[2], "w").write('wrk.method = "POST"\nwrk.headers["content-type"] = "application/json"\nwrk.body = ' + json.dumps(s) + '\n')
PY

UP=$(free_port)
ANSWER='{"id":"chatcmpl-1","object":"chat.completion","model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":512,"completion_tokens":1,"total_tokens":513,"prompt_tokens_details":{"cached_tokens":0}}}'
nginx_conf() { # $1 name, $2 server block
  cat >"$WORK/$1.conf" <<NGINX
worker_processes 1;
pid $WORK/$1.pid;
error_log $WORK/$1-error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK; proxy_temp_path $WORK; fastcgi_temp_path $WORK;
  uwsgi_temp_path $WORK; scgi_temp_path $WORK;
  $2
}
NGINX
  nginx -c "$WORK/$1.conf"
  for _ in $(seq 1 50); do [ -s "$WORK/$1.pid" ] && break; sleep 0.1; done
}
nginx_conf nginx-up "server { listen 127.0.0.1:$UP; client_max_body_size 1m; location / { default_type application/json; return 200 '$ANSWER'; } }"
NGP=$(free_port)
nginx_conf nginx-proxy "upstream up { server 127.0.0.1:$UP; keepalive 16; } server { listen 127.0.0.1:$NGP; location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; } }"

case "$SCHED" in
  balance) SCHED_YAML="" ;;
  layered) SCHED_YAML=$'    scheduler:\n      mode: layered\n      affinity: {}\n      prefix: {}\n' ;;
  policy) SCHED_YAML=$'    scheduler:\n      mode: policy\n      plugins: [{kind: session-affinity}, {kind: least-inflight}, {kind: prefix-cache}]\n' ;;
esac

declare -A URL
URL[direct]=http://127.0.0.1:$UP/v1/chat/completions
URL[nginx-proxy]=http://127.0.0.1:$NGP/v1/chat/completions
TARGETS=(direct nginx-proxy)
i=0
for BIN in "${BINS[@]}"; do
  i=$((i + 1)); name="tg$i"
  port=$(free_port); adm=$(free_port)
  cat >"$WORK/$name.yaml" <<YAML
listen: ["127.0.0.1:$port"]
admin_listen: "127.0.0.1:$adm"
threads: 2
health_check: {enabled: false}
services:
  - name: bench-model
${SCHED_YAML}    instances:
      - { id: up, addr: "127.0.0.1:$UP" }
YAML
  RUST_LOG=warn "$BIN" serve -c "$WORK/$name.yaml" >"$WORK/$name.out" 2>"$WORK/$name.log" &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$adm/health"
  URL[$name]=http://127.0.0.1:$port/v1/chat/completions
  TARGETS+=("$name")
done

for r in $(seq 1 "$ROUNDS"); do
  n=${#TARGETS[@]}
  for k in $(seq 0 $((n - 1))); do
    t=${TARGETS[$(((k + r - 1) % n))]}
    wrk -t1 -c1 -d1s -s "$WORK/post.lua" "${URL[$t]}" >/dev/null
    wrk -t1 -c1 -d"$DUR" --latency -s "$WORK/post.lua" "${URL[$t]}" >"$WORK/$t-$r.txt"
  done
  echo "round $r/$ROUNDS done" >&2
done

CG=""
for BIN in "${BINS[@]}"; do
  CG+="$(SCHED=$SCHED bench/callgrind.sh "$BIN" 2>/dev/null | tail -1)"$'\n'
done

python3 - "$WORK" "$ROUNDS" "$SCHED" "${OUT:-}" "$CG" "${TARGETS[@]}" -- "${BINS[@]}" <<'PY'
import sys, os, re, statistics as st, datetime, subprocess
work, rounds, sched, out, cg = sys.argv[1:6]
rest = sys.argv[6:]; sep = rest.index("--")
targets, bins = rest[:sep], rest[sep + 1:]
rounds = int(rounds)
def us(v, unit):
    return float(v) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]
def parse(t, r):
    txt = open(os.path.join(work, f"{t}-{r}.txt")).read()
    p = {}
    for q in ("50", "99"):
        m = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)", txt, re.M)
        p[q] = us(*m.groups())
    m = re.search(r"Requests/sec:\s+([\d.]+)", txt)
    p["rps"] = float(m.group(1))
    return p
res = {t: [parse(t, r) for r in range(1, rounds + 1)] for t in targets}
names = {"direct": "direct (wrk → nginx `return 200`)", "nginx-proxy": "nginx as a proxy (1 worker, keepalive)"}
for i, b in enumerate(bins, 1):
    names[f"tg{i}"] = f"`{b}`"
lines = []
lines.append(f"Run {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, {os.cpu_count()} cores, scheduler `{sched}`, {rounds} interleaved rounds, wrk 1 connection, 2 KB chat request; medians.\n")
lines.append("| path | p50 µs | p99 µs | added p50 µs (vs direct, per round, median) | req/s at 1 conn |")
lines.append("|---|---|---|---|---|")
for t in targets:
    p50 = st.median(x["50"] for x in res[t]); p99 = st.median(x["99"] for x in res[t])
    added = st.median(a["50"] - d["50"] for a, d in zip(res[t], res["direct"]))
    rps = st.median(x["rps"] for x in res[t])
    lines.append(f"| {names[t]} | {p50:.0f} | {p99:.0f} | {added:+.0f} | {rps:.0f} |")
lines.append("")
lines.append("Instructions per request (callgrind, `bench/callgrind.sh`, engine-sim upstream):\n")
for l in cg.strip().splitlines():
    lines.append(f"- {l}")
report = "\n".join(lines) + "\n"
print(report)
if out:
    open(out, "a").write(report)
PY
