#!/usr/bin/env bash
# Traffic mirroring off the client's path (issue 14): client latency through tokengate with
#   none      no mirror block
#   stalled   mirror ratio 100 to a target that accepts connections and never answers
#             (every copy waits its timeout_ms, the queue fills, the rest is dropped)
#   fast      mirror ratio 100 to a second nginx that answers at once (the mirror's real
#             work: one extra upstream request per client request, on the same cores)
# in front of a zero-latency upstream (nginx `return 200` with a chat-shaped JSON body and
# usage). The modes alternate round by round (ROUNDS rounds of DURATION each), each round a
# pair of wrk runs against the same running gateways: one connection (latency: no queueing
# in the gateway, p50/p99 are its per-request time) and CONNECTIONS connections (saturation:
# requests/s and the gateway's CPU time per request, from /proc). Reports each round and the
# median over rounds, plus the gateways' mirror counters.
# Usage: [ROUNDS=5] [DURATION=8s] [CONNECTIONS=8] [TIMEOUT_MS=5000] bench/mirroring.sh
# Needs wrk and nginx. Writes bench/results/mirroring.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-8s}
CONNECTIONS=${CONNECTIONS:-8}
TIMEOUT_MS=${TIMEOUT_MS:-5000}
command -v wrk >/dev/null || { echo "wrk missing (apt-get install wrk)" >&2; exit 1; }
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || { echo "nginx missing (apt-get install nginx)" >&2; exit 1; }
cargo build --release --quiet --bin tokengate
BIN=target/release/tokengate
. bench/lib.sh

# Two nginx servers in one process: the upstream and the fast mirror target.
UP=$(free_port); FAST=$(free_port)
start_nginx_200 "$UP" "$FAST"

# The stalled target: accepts, reads, never answers; closes when the gateway gives up.
STALL=$(free_port)
python3 - "$STALL" >"$WORK/stall.log" 2>&1 <<'PY' &
import asyncio, sys
async def hold(reader, writer):
    try:
        while await reader.read(65536):
            pass
    finally:
        writer.close()
async def main():
    srv = await asyncio.start_server(hold, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    async with srv:
        await srv.serve_forever()
asyncio.run(main())
PY
PIDS+=($!)
for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/$STALL) 2>/dev/null && break; sleep 0.1; done

# utime + stime of a process, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

declare -A GW ADM GPID
for mode in none stalled fast; do
  gw=$(free_port); adm=$(free_port)
  GW[$mode]=$gw; ADM[$mode]=$adm
  mirror=""
  case $mode in
    stalled) mirror="mirror: { target: \"http://127.0.0.1:$STALL\", ratio: 100, timeout_ms: $TIMEOUT_MS }" ;;
    fast) mirror="mirror: { target: \"http://127.0.0.1:$FAST\", ratio: 100, timeout_ms: $TIMEOUT_MS }" ;;
  esac
  cat >"$WORK/$mode.yaml" <<YAML
listen: ["127.0.0.1:$gw"]
admin_listen: "127.0.0.1:$adm"
threads: 2
health_check: { enabled: false }
services:
  - name: m
    instances:
      - { id: nginx, addr: "127.0.0.1:$UP" }
$mirror
YAML
  RUST_LOG=warn $BIN serve -c "$WORK/$mode.yaml" >"$WORK/$mode.out" 2>"$WORK/$mode.log" &
  PIDS+=($!); GPID[$mode]=$!
  wait_http "http://127.0.0.1:$adm/health"
  # Warm-up (connections, allocator).
  wrk -t1 -c"$CONNECTIONS" -d2s -s bench/wrk/chat.lua "http://127.0.0.1:$gw/v1/chat/completions" >/dev/null
done

for r in $(seq 1 "$ROUNDS"); do
  for mode in none stalled fast; do
    echo "round $r: $mode" >&2
    url="http://127.0.0.1:${GW[$mode]}/v1/chat/completions"
    wrk -t1 -c1 -d"$DURATION" --latency -s bench/wrk/chat.lua "$url" >"$WORK/$mode-$r-c1.txt"
    before=$(cpu_ticks "${GPID[$mode]}")
    wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency -s bench/wrk/chat.lua "$url" >"$WORK/$mode-$r.txt"
    echo $(( $(cpu_ticks "${GPID[$mode]}") - before )) >"$WORK/$mode-$r.cpu"
  done
done
for mode in none stalled fast; do
  curl -s "http://127.0.0.1:${ADM[$mode]}/metrics" >"$WORK/$mode-metrics.txt"
  curl -s "http://127.0.0.1:${ADM[$mode]}/admin/instances" >"$WORK/$mode-instances.json"
done

TICKS=$(getconf CLK_TCK)
python3 - "$WORK" "$ROUNDS" "$DURATION" "$CONNECTIONS" "$TIMEOUT_MS" "$TICKS" <<'PY'
import json, os, re, sys, datetime, platform, subprocess, statistics
work, rounds, dur, conns, timeout_ms, ticks = sys.argv[1:7]
ticks = int(ticks)
rounds = int(rounds)
def ms(v, unit):
    return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
def parse(path):
    t = open(path).read()
    lat = {}
    for p, v, u in re.findall(r"^\s+(50|99|99\.900)%\s+([\d.]+)(us|ms|s)\s*$", t, re.M):
        lat[p] = ms(v, u)
    # wrk prints 50/75/90/99; p99.9 is not in --latency output: use the max as a ceiling.
    mx = re.search(r"Latency\s+[\d.]+\w+\s+[\d.]+\w+\s+([\d.]+)(us|ms|s)", t)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    errs = re.search(r"Socket errors:.*", t)
    total = int(re.search(r"(\d+) requests in", t).group(1))
    return dict(p50=lat["50"], p99=lat["99"], max=ms(*mx.groups()), rps=rps,
                bad=int(non2xx.group(1)) if non2xx else 0, socket=errs.group(0) if errs else "", n=total)
modes = ["none", "stalled", "fast"]
res = {m: [parse(os.path.join(work, f"{m}-{r}.txt")) for r in range(1, rounds + 1)] for m in modes}
one = {m: [parse(os.path.join(work, f"{m}-{r}-c1.txt")) for r in range(1, rounds + 1)] for m in modes}
for m in modes:
    for r, x in enumerate(res[m], 1):
        x["cpu_us"] = int(open(os.path.join(work, f"{m}-{r}.cpu")).read()) / ticks * 1e6 / max(x["n"], 1)
def counters(m):
    t = open(os.path.join(work, f"{m}-metrics.txt")).read()
    out = {}
    for o, v in re.findall(r'^tokengate_mirror_requests_total\{outcome="(\w+)"\} (\d+)', t, re.M):
        out[o] = int(v)
    return out
def leak(m):
    inst = json.load(open(os.path.join(work, f"{m}-instances.json")))["instances"]
    return sum(i["inflight_requests"] + i["waiting"] for i in inst)
ver = subprocess.run(["target/release/tokengate", "--version"], capture_output=True, text=True).stdout.strip()
cpu = ""
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except Exception:
    pass
load = os.getloadavg()
out = "bench/results/mirroring.md"
with open(out, "w") as f:
    f.write("# Traffic mirroring: client latency\n\n")
    f.write(f"Run {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} on {os.cpu_count()} cores ({cpu}), "
            f"{platform.platform()}, {ver}; load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}. "
            f"Command: `ROUNDS={rounds} DURATION={dur} CONNECTIONS={conns} TIMEOUT_MS={timeout_ms} bench/mirroring.sh`.\n\n")
    f.write("Upstream: nginx `return 200` (a chat completion with usage). Three gateways (release build, `threads: 2`, "
            "`RUST_LOG=warn`) differ only in `mirror`: **none**; **stalled** = `ratio: 100` to a target that accepts and "
            f"never answers (`timeout_ms: {timeout_ms}`); **fast** = `ratio: 100` to a second nginx. wrk, 1 thread, "
            f"closed loop, {dur} per run: first 1 connection (latency without queueing), then {conns} connections "
            "(saturation: requests/s and the gateway process's CPU time per request); the modes alternate within each round. "
            "Everything (wrk, nginx, the gateways, the stalled target) shares the same cores; numbers are medians over rounds, "
            "the worst max over rounds.\n\n")
    f.write("### 1 connection: client latency\n\n")
    f.write("| mode | p50 ms | p99 ms | max ms | req/s | non-2xx | rounds p50 / p99 ms |\n")
    f.write("|---|---|---|---|---|---|---|\n")
    for m in modes:
        rs = one[m]
        med = lambda k: statistics.median(r[k] for r in rs)
        per = ", ".join(f"{r['p50']:.3f}/{r['p99']:.3f}" for r in rs)
        f.write(f"| {m} | {med('p50'):.3f} | {med('p99'):.3f} | {max(r['max'] for r in rs):.1f} | {med('rps'):.0f} | "
                f"{sum(r['bad'] for r in rs)} | {per} |\n")
    f.write(f"\n### {conns} connections: saturation\n\n")
    f.write("| mode | p50 ms | p99 ms | max ms | req/s | gateway CPU µs/request | non-2xx | rounds req/s |\n")
    f.write("|---|---|---|---|---|---|---|---|\n")
    for m in modes:
        rs = res[m]
        med = lambda k: statistics.median(r[k] for r in rs)
        per = ", ".join(f"{r['rps']:.0f}" for r in rs)
        f.write(f"| {m} | {med('p50'):.3f} | {med('p99'):.3f} | {max(r['max'] for r in rs):.1f} | {med('rps'):.0f} | "
                f"{med('cpu_us'):.1f} | {sum(r['bad'] for r in rs)} | {per} |\n")
    f.write("\nMirror counters at the end (`tokengate_mirror_requests_total`), and requests left in the load table:\n\n")
    f.write("| mode | client requests | sent | ok | timeout | error | dropped | expired | in flight after |\n|---|---|---|---|---|---|---|---|---|\n")
    for m in modes:
        c = counters(m)
        n = sum(r["n"] for r in res[m]) + sum(r["n"] for r in one[m])
        f.write(f"| {m} | {n} (+ warm-up) | {c.get('sent', '-')} | {c.get('ok', '-')} | {c.get('timeout', '-')} | {c.get('error', '-')} | "
                f"{c.get('dropped', '-')} | {c.get('expired', '-')} | {leak(m)} |\n")
    f.write("\n<!-- discussion -->\n")
print(open(out).read())
PY
