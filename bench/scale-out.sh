#!/usr/bin/env bash
# Several replicas (issue 30): the multi-tenant agentic load of bench/tail.sh against one fleet
# of engine-sims, in the same run, through
#   one               one tokengate replica (the reference)
#   three-redis       three replicas sharing state on a local redis-server (`cluster: {redis}`)
#   three-alone       three replicas without `cluster:` (each on its own)
#   three-rendezvous  three replicas without Redis, `cluster: {placement: rendezvous}` (they
#                     share nothing but place new sessions and prefixes by the same hash)
# LB=haproxy (default): the client talks to HAProxy (TCP mode, round-robin per connection, as
# docker/haproxy.cfg), which spreads its pooled keep-alive connections over the replicas, so a
# session's turns reach whichever replica the connection they borrow leads to; installed with
# apt-get when missing. LB=client: the client round-robins per request itself (bench replay
# --url a --url b --url c), every turn to the next replica, the hardest case for shared state.
# Every mode scrapes the engines' metrics (`engine_metrics`: rendezvous weighs by them).
# Reported per mode and seed: requests, failures, the engines' cached ratio, TTFT p50/p99
# (client), the decisions taken by rendezvous, and with Redis: the routing path's Redis round
# trip (mean, and p50/p99 from the histogram's buckets), Redis calls and Redis commands per
# request (redis-server's own count).
# Usage: [SEEDS="1 2"] [MODES=…] [RATE=1.5] [DURATION=40] [LB=haproxy|client] [BUILD=1] [REPORT_ONLY=1] bench/scale-out.sh
# Needs redis-server (scripts/setup.sh). Writes bench/results/scale-out.md; raw results under
# target/bench/scale-out/<seed>/<mode>/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SEEDS=${SEEDS:-${SEED:-1}}
LB=${LB:-haproxy}
RATE=${RATE:-1.5}
DURATION=${DURATION:-40}
DRAIN=${DRAIN:-15}
ENGINES=${ENGINES:-4}
KV_BLOCKS=${KV_BLOCKS:-2048}
BLOCK_SIZE=16
PREFILL_TPS=${PREFILL_TPS:-2000}
SIM_TIME_SCALE=${SIM_TIME_SCALE:-4}
MODES=${MODES:-"one three-redis three-alone three-rendezvous"}
OUT=${OUT:-target/bench/scale-out}
MD=${MD:-bench/results/scale-out.md}
MODEL=m
BIN=${BIN:-$ROOT/target/release/tokengate}
SIM_FLAGS="--time-scale $SIM_TIME_SCALE --kv-blocks $KV_BLOCKS --block-size $BLOCK_SIZE --prefill-tps $PREFILL_TPS --max-running 64"
WL_FLAGS="--agentic --tenants 40 --zipf 1.1 --system-tokens 2048-4096 --user-tokens 128-640 --output-tokens 32-128 --one-shot 0.25 --turns 2-12 --think-time 100ms --engine-block-size $BLOCK_SIZE --duration ${DURATION}s --drain-timeout ${DRAIN}s"
command -v redis-server >/dev/null || { echo "redis-server missing: scripts/setup.sh" >&2; exit 1; }
case $LB in haproxy|client) ;; *) echo "LB=$LB: expected haproxy or client" >&2; exit 1 ;; esac
if [ "$LB" = haproxy ] && ! command -v haproxy >/dev/null; then
  echo "haproxy missing: installing it (apt-get install -y haproxy), the L4 balancer in front of the replicas" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y haproxy >/dev/null 2>&1 || { $SUDO apt-get update -qq && $SUDO apt-get install -y haproxy >/dev/null; } \
    || { echo "could not install haproxy; run with LB=client to skip it" >&2; exit 1; }
fi
if [ "${BUILD:-1}" = 1 ]; then cargo build --release --bin tokengate --quiet; fi
[ -x "$BIN" ] || { echo "no $BIN (run without BUILD=0)" >&2; exit 1; }
. bench/lib.sh
mkdir -p "$OUT"

start_fleet() {
  INST=""
  local i p
  for i in $(seq 1 "$ENGINES"); do
    p=$(free_port)
    # shellcheck disable=SC2086
    "$BIN" engine-sim --listen "127.0.0.1:$p" --id "e$i" --model "$MODEL" $SIM_FLAGS >"$WORK/e$i.log" 2>&1 &
    PIDS+=($!); FLEET+=($!)
    wait_http "http://127.0.0.1:$p/health"
    INST+="      - { id: e$i, addr: \"127.0.0.1:$p\" }"$'\n'
  done
}

start_redis() {
  REDIS_PORT=$(free_port)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 &
  PIDS+=($!); REDIS_PID=$!
  for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "redis-server did not start" >&2; exit 1
}

# $1 = replica name, $2 = cluster block (or empty); sets URLS+=, GW_PORTS+=, ADMINS+=
start_gw() {
  local gw adm; gw=$(free_port); adm=$(free_port)
  cat >"$WORK/$1.yaml" <<YAML
listen: ["127.0.0.1:$gw"]
admin_listen: "127.0.0.1:$adm"
threads: 1
timeouts: { first_byte: 120s }
$2
services:
  - name: $MODEL
    load_balancing: least-token
    scheduler: { mode: layered, affinity: {}, prefix: {} }
    engine_metrics: { interval: 200ms }
    instances:
$INST
YAML
  RUST_LOG=warn "$BIN" serve -c "$WORK/$1.yaml" >"$WORK/$1.out" 2>"$WORK/$1.log" &
  PIDS+=($!); GWS+=($!)
  wait_http "http://127.0.0.1:$adm/health"
  URLS+=(--url "http://127.0.0.1:$gw"); GW_PORTS+=("$gw"); ADMINS+=("http://127.0.0.1:$adm")
}

# HAProxy in TCP mode, round-robin per connection, over GW_PORTS; sets LB_URL.
start_lb() {
  local port i=1 p; port=$(free_port)
  {
    printf 'global\n  maxconn 4096\ndefaults\n  mode tcp\n  timeout connect 3s\n  timeout client 30m\n  timeout server 30m\n'
    printf 'frontend api\n  bind 127.0.0.1:%s\n  default_backend replicas\nbackend replicas\n  balance roundrobin\n' "$port"
    for p in "${GW_PORTS[@]}"; do printf '  server r%s 127.0.0.1:%s\n' "$i" "$p"; i=$((i + 1)); done
  } >"$WORK/haproxy.cfg"
  haproxy -db -f "$WORK/haproxy.cfg" >"$WORK/haproxy.log" 2>&1 &
  PIDS+=($!); LB_PID=$!
  wait_http "http://127.0.0.1:$port/v1/models"
  LB_URL="http://127.0.0.1:$port"
}

run_mode() { # $1 = mode, $2 = seed
  local mode=$1 SEED=$2 dir=$OUT/$2/$1 n=3 cluster=""
  rm -rf "$dir"; mkdir -p "$dir"
  FLEET=(); GWS=(); URLS=(); GW_PORTS=(); ADMINS=()
  start_fleet
  [ "$mode" = one ] && n=1
  if [ "$mode" = three-redis ]; then
    start_redis
    cluster=$'cluster:\n  redis: { url: "redis://127.0.0.1:'"$REDIS_PORT"$'", timeout: 50ms }'
  fi
  [ "$mode" = three-rendezvous ] && cluster=$'cluster:\n  placement: rendezvous'
  local r
  for r in $(seq 1 $n); do start_gw "r$r" "${cluster:+$cluster$'\n'  replica: r$r}"; done
  if [ "$LB" = haproxy ]; then start_lb; URLS=(--url "$LB_URL"); fi
  echo "== seed $SEED, $mode: $n replica(s) via $LB, rate $RATE sessions/s, ${DURATION}s" >&2
  # shellcheck disable=SC2086
  timeout -k 5 $((DURATION + DRAIN + 60)) "$BIN" bench replay --model "$MODEL" "${URLS[@]}" --url-policy round-robin \
    $WL_FLAGS --seed "$SEED" --rate "$RATE" --out-json "$dir/report.json" --out-md "$dir/report.md" \
    >/dev/null 2>"$dir/replay.log" || echo "   replay failed (exit $?), see $dir/replay.log" >&2
  sleep 0.5
  local a i=1
  for a in "${ADMINS[@]}"; do curl -sf "$a/metrics" >"$dir/r$i.metrics.txt" || true; i=$((i + 1)); done
  if [ "$mode" = three-redis ]; then
    redis-cli -p "$REDIS_PORT" info stats | tr -d '\r' >"$dir/redis-stats.txt"
    redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r' >"$dir/redis-commandstats.txt"
    stop "$REDIS_PID"
  fi
  [ "$LB" = haproxy ] && stop "$LB_PID"
  stop "${GWS[@]}"; stop "${FLEET[@]}"
  for i in $(seq 1 $n); do gzip -c "$WORK/r$i.log" >"$dir/r$i.log.gz"; cp "$WORK/r$i.yaml" "$dir/"; done
}

# REPORT_ONLY=1: rewrite the page from the raw results already under $OUT.
if [ "${REPORT_ONLY:-0}" != 1 ]; then
  for s in $SEEDS; do for m in $MODES; do run_mode "$m" "$s"; done; done
fi

python3 - "$OUT" "$MD" "$MODES" "$SEEDS" "$RATE" "$DURATION" "$SIM_FLAGS" "$WL_FLAGS" "$LB" <<'PY'
import json, os, re, sys
out, md, modes, seeds, rate, dur, simf, wlf, lb = sys.argv[1:10]
def metrics(d):
    fam = {}
    for f in sorted(os.listdir(d)):
        if not f.endswith(".metrics.txt"): continue
        for line in open(os.path.join(d, f)):
            if line.startswith("#"): continue
            m = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line.strip())
            if m: fam.setdefault(m.group(1) + (m.group(2) or ""), 0.0); fam[m.group(1) + (m.group(2) or "")] += float(m.group(3))
    return fam
def quantile(fam, q):
    bs = sorted(((float("inf") if k.split('le="')[1].rstrip('"}') == "+Inf" else float(k.split('le="')[1].rstrip('"}')), v)
                for k, v in fam.items() if k.startswith("tokengate_cluster_redis_rtt_seconds_bucket")), key=lambda x: x[0])
    if not bs or bs[-1][1] == 0: return None
    want = q * bs[-1][1]
    for le, c in bs:
        if c >= want: return le
def row_of(d, mode):
    try: r = json.load(open(os.path.join(d, "report.json")))
    except Exception: return None
    fam = metrics(d)
    t = r.get("ttft_ms") or r.get("ttft") or {}
    row = {"mode": mode, "ok": r["counts"]["ok"], "failed": r["counts"]["failed"],
           "cached": r["tokens"]["cached_ratio"],
           "p50": t.get("p50"), "p99": t.get("p99")}
    reqs = sum(v for k, v in fam.items() if k.startswith("tokengate_requests_total"))
    dec = sum(v for k, v in fam.items() if k.startswith("tokengate_routing_decisions_total"))
    rv = sum(v for k, v in fam.items() if k.startswith('tokengate_routing_decisions_total{reason="rendezvous'))
    row["rendezvous"] = rv / dec if dec else None
    if mode == "three-redis":
        n = fam.get("tokengate_cluster_redis_rtt_seconds_count", 0)
        row["rtt_mean_ms"] = fam.get("tokengate_cluster_redis_rtt_seconds_sum", 0) / n * 1000 if n else None
        row["rtt_p50_ms"] = (quantile(fam, 0.5) or 0) * 1000
        row["rtt_p99_ms"] = (quantile(fam, 0.99) or 0) * 1000
        calls = sum(v for k, v in fam.items() if k.startswith("tokengate_cluster_redis_calls_total") and 'op="heartbeat"' not in k and 'op="members"' not in k)
        row["calls_per_req"] = calls / reqs if reqs else None
        st = open(os.path.join(d, "redis-stats.txt")).read()
        cmds = int(re.search(r"total_commands_processed:(\d+)", st).group(1))
        row["cmds_per_req"] = cmds / reqs if reqs else None
        row["applied"] = sum(v for k, v in fam.items() if k.startswith("tokengate_cluster_events_applied_total"))
    return row
runs = {}  # (seed, mode) -> row
for seed in seeds.split():
    for mode in modes.split():
        runs[(seed, mode)] = row_of(os.path.join(out, seed, mode), mode)
rel = lambda a, b: f"{a / b:.3f}×" if (a is not None and b) else "–"
via = ("HAProxy (TCP mode, round-robin per connection) in front of the replica(s); the client's pooled keep-alive "
       "connections are spread over them, so a session's turns reach whichever replica the borrowed connection leads to"
       if lb == "haproxy" else "the client round-robin **per request** over the replicas (every turn to the next one)")
with open(md, "w") as f:
    f.write("# Several replicas: 1 vs 3, with and without Redis (issue 30)\n\n")
    f.write(f"`SEEDS=\"{seeds}\" LB={lb} bench/scale-out.sh`: {rate} sessions/s for {dur} s per run, the same engine-sim fleet "
            "for every mode (restarted empty between runs), every replica scraping the engines' metrics every 200 ms. "
            f"Requests go through {via}. TTFT as the client saw it; cached ratio as the engines reported it; "
            "`rendezvous` = the share of routing decisions taken by rendezvous placement.\n\n")
    f.write(f"- engines: `{simf}`\n- workload: `{wlf}`\n\n")
    f.write("| seed | mode | ok | failed | cached ratio | vs one | TTFT p50 ms | TTFT p99 ms | p99 vs one | rendezvous |\n|---|---|---|---|---|---|---|---|---|---|\n")
    for seed in seeds.split():
        ref = runs.get((seed, "one"))
        for mode in modes.split():
            r = runs[(seed, mode)]
            if r is None: f.write(f"| {seed} | {mode} | run failed | | | | | | | |\n"); continue
            rvs = f"{r['rendezvous']:.2f}" if r.get("rendezvous") else "–"
            f.write(f"| {seed} | {mode} | {r['ok']} | {r['failed']} | {r['cached']:.3f} | {rel(r['cached'], ref and ref['cached'])} | "
                    f"{(r['p50'] or 0):.0f} | {(r['p99'] or 0):.0f} | {rel(r['p99'], ref and ref['p99'])} | {rvs} |\n")
    if len(seeds.split()) > 1:
        f.write("\n**Mean over the seeds** (ratios: mean of the per-seed ratios)\n\n| mode | cached ratio | vs one | TTFT p99 ms | p99 vs one |\n|---|---|---|---|---|\n")
        for mode in modes.split():
            rs = [(runs[(s, mode)], runs.get((s, "one"))) for s in seeds.split() if runs[(s, mode)]]
            if not rs: continue
            mean = lambda xs: sum(xs) / len(xs) if xs else None
            c = mean([r["cached"] for r, _ in rs]); p = mean([r["p99"] or 0 for r, _ in rs])
            cr = mean([r["cached"] / o["cached"] for r, o in rs if o and o["cached"]])
            pr = mean([(r["p99"] or 0) / o["p99"] for r, o in rs if o and o["p99"]])
            f.write(f"| {mode} | {c:.3f} | {cr:.3f}× | {p:.0f} | {pr:.3f}× |\n")
    for (seed, mode), r in runs.items():
        if r and mode == "three-redis":
            f.write(f"\n**Redis on the routing path** (three-redis, seed {seed}, all replicas): ")
            f.write(f"round trip mean {r['rtt_mean_ms']:.3f} ms, p50 ≤ {r['rtt_p50_ms']:.2f} ms, p99 ≤ {r['rtt_p99_ms']:.2f} ms "
                    "(histogram bucket bounds); ")
            f.write(f"{r['calls_per_req']:.2f} Redis calls per request from the request path and the writer (a pipelined batch is one call), "
                    f"{r['cmds_per_req']:.2f} commands per request as redis-server counted them (heartbeats included); "
                    f"{r['applied']:.0f} events of other replicas applied.\n")
    f.write("\n<!-- discussion -->\n")
print(open(md).read())
PY
