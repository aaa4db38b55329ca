#!/usr/bin/env bash
# What `cluster:` adds to a request (issue 30): the same gateway config with and without
# `cluster.redis` (a local redis-server), in front of a zero-latency upstream (two nginx
# `return 200` servers: two instances, so the layered scheduler's affinity layer reads the
# session), every request with one of 64 session keys (bench/wrk/session.lua): with Redis each
# request waits for one GET of its session's binding, and its dispatch writes the binding and
# publishes its placement (off the request's path). wrk, 1 thread: p50/p99 at 1 connection,
# req/s and p99 at 32; ROUNDS interleaved rounds, medians reported.
# Usage: [ROUNDS=3] [DURATION=5s] [BUILD=1] bench/cluster-latency.sh
# Needs wrk, nginx, redis-server. Writes bench/results/cluster-latency.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5s}
BIN=target/release/tokengate
for t in wrk redis-server; do command -v $t >/dev/null || { echo "$t missing" >&2; exit 1; }; done
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || { echo "nginx missing (apt-get install nginx-light)" >&2; exit 1; }
if [ "${BUILD:-1}" = 1 ]; then cargo build --release --bin tokengate --quiet; fi
. bench/lib.sh

UP1=$(free_port); UP2=$(free_port)
start_nginx_200 "$UP1" "$UP2"
REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done

declare -A GW ADM
for mode in alone cluster; do
  gw=$(free_port); adm=$(free_port); GW[$mode]=$gw; ADM[$mode]=$adm
  cluster=""
  [ "$mode" = cluster ] && cluster="cluster: { redis: { url: \"redis://127.0.0.1:$REDIS_PORT\", timeout: 50ms } }"
  cat >"$WORK/$mode.yaml" <<YAML
listen: ["127.0.0.1:$gw"]
admin_listen: "127.0.0.1:$adm"
threads: 2
health_check: { enabled: false }
$cluster
services:
  - name: m
    instances:
      - { id: n1, addr: "127.0.0.1:$UP1" }
      - { id: n2, addr: "127.0.0.1:$UP2" }
YAML
  RUST_LOG=warn $BIN serve -c "$WORK/$mode.yaml" >"$WORK/$mode.out" 2>"$WORK/$mode.log" &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$adm/health"
  wrk -t1 -c32 -d2s -s bench/wrk/session.lua "http://127.0.0.1:$gw/v1/chat/completions" >/dev/null
done
for r in $(seq 1 "$ROUNDS"); do
  for mode in alone cluster; do
    echo "round $r: $mode" >&2
    url="http://127.0.0.1:${GW[$mode]}/v1/chat/completions"
    wrk -t1 -c1 -d"$DURATION" --latency -s bench/wrk/session.lua "$url" >"$WORK/$mode-$r-c1.txt"
    wrk -t1 -c32 -d"$DURATION" --latency -s bench/wrk/session.lua "$url" >"$WORK/$mode-$r-c32.txt"
  done
done
curl -s "http://127.0.0.1:${ADM[cluster]}/metrics" >"$WORK/cluster-metrics.txt"
redis-cli -p "$REDIS_PORT" info stats | tr -d '\r' >"$WORK/redis-stats.txt"

python3 - "$WORK" "$ROUNDS" "$DURATION" <<'PY'
import re, statistics, sys
work, rounds, dur = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def ms(v, u): return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[u]
def parse(p):
    t = open(p).read()
    lat = {k: ms(v, u) for k, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", t, re.M)}
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    return lat, float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1)), int(bad.group(1)) if bad else 0
rows = {}
for mode in ["alone", "cluster"]:
    c1 = [parse(f"{work}/{mode}-{r}-c1.txt") for r in range(1, rounds + 1)]
    c32 = [parse(f"{work}/{mode}-{r}-c32.txt") for r in range(1, rounds + 1)]
    med = statistics.median
    rows[mode] = dict(p50=med(x[0]["50"] for x in c1), p99=med(x[0]["99"] for x in c1),
                      rps=med(x[1] for x in c32), p99_32=med(x[0]["99"] for x in c32),
                      bad=sum(x[2] for x in c1 + c32))
m = open(f"{work}/cluster-metrics.txt").read()
def val(name):
    return sum(float(l.split()[-1]) for l in m.splitlines() if l.startswith(name))
reqs = val("tokengate_requests_total{")
calls = sum(float(l.split()[-1]) for l in m.splitlines()
            if l.startswith("tokengate_cluster_redis_calls_total{") and 'op="session_get"' in l)
cmds = int(re.search(r"total_commands_processed:(\d+)", open(f"{work}/redis-stats.txt").read()).group(1))
n = val("tokengate_cluster_redis_rtt_seconds_count")
mean = val("tokengate_cluster_redis_rtt_seconds_sum") / n * 1000 if n else 0
a, c = rows["alone"], rows["cluster"]
out = ["# What `cluster:` adds to a request (issue 30)", "",
       f"`bench/cluster-latency.sh`: one gateway (release build, `threads: 2`) with and without `cluster.redis` (local redis-server), "
       "two nginx `return 200` instances, every request with one of 64 session keys; wrk 1 thread, "
       f"{rounds} interleaved rounds of {dur}, medians. Everything shares the same 2 cores.", "",
       "| | p50 ms (1 conn) | p99 ms (1 conn) | req/s (32 conns) | p99 ms (32 conns) | non-2xx |", "|---|---|---|---|---|---|"]
for k in ["alone", "cluster"]:
    r = rows[k]
    out.append(f"| {k} | {r['p50']:.3f} | {r['p99']:.3f} | {r['rps']:.0f} | {r['p99_32']:.2f} | {r['bad']} |")
out += ["", f"Added by `cluster:`: p50 {c['p50'] - a['p50']:+.3f} ms, p99 {c['p99'] - a['p99']:+.3f} ms at 1 connection; "
        f"throughput {c['rps'] / a['rps']:.2f}× at 32. Session reads {calls / reqs:.2f} per request "
        f"(mean round trip {mean:.3f} ms as the gateway measured it); redis-server processed {cmds / reqs:.2f} commands per request "
        "over the whole run (the session read, the pipelined binding and placement writes, and the time-driven heartbeat "
        "and load exchange).", ""]
open("bench/results/cluster-latency.md", "w").write("\n".join(out))
print("\n".join(out))
PY
