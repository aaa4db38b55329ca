#!/usr/bin/env bash
# Holds STREAMS concurrent streaming chat requests through the gateway to engine-sims, checks
# that every one of them completes (status 200, [DONE], no error), and measures the gateway's
# memory per stream: (VmRSS during the plateau − VmRSS idle) / STREAMS.
#
# Usage: bench/load.sh [STREAMS=2000] [TOKENS=20] [SIMS=4]
#   Each stream generates TOKENS tokens, one per second (engine-sims with a constant 1 s decode
#   step and no batch limit), so a stream lasts ~TOKENS s; streams are opened at ~1000/s.
# Output: a JSON summary on stdout; exit 1 if any stream failed or the load table did not
# return to zero. Results are recorded by hand in bench/results/reliability.md.
# Needs python3 (stdlib only). Loopback only; picks free ports.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-2000}; TOKENS=${2:-20}; SIMS=${3:-4}
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
need=$((STREAMS * 2 + 1000))
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$need" ]; then
  echo "ulimit -n is $(ulimit -n); $STREAMS streams need about $need descriptors" >&2; exit 1
fi
./scripts/setup.sh >/dev/null
cargo build --profile dist --quiet
BIN=target/dist/tokengate
. bench/lib.sh
INST=""
for i in $(seq 1 "$SIMS"); do
  P=$(free_port)
  $BIN engine-sim --listen 127.0.0.1:$P --id e$i --model m --max-running 100000 \
    --kv-blocks 2000000 --decode-step-ms 1000 --decode-per-req-ms 0 --chunk-tokens 1 \
    >"$WORK/e$i.log" 2>&1 &
  PIDS+=($!); wait_http http://127.0.0.1:$P/health
  INST+="      - { id: e$i, addr: \"127.0.0.1:$P\" }"$'\n'
done
GW=$(free_port); ADM=$(free_port)
cat >"$WORK/gw.yaml" <<YAML
listen: ["127.0.0.1:$GW"]
admin_listen: "127.0.0.1:$ADM"
threads: 2
services:
  - name: m
    load_balancing: least-request
    instances:
$INST
YAML
RUST_LOG=warn $BIN serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
GWPID=$!; PIDS+=($GWPID); wait_http http://127.0.0.1:$ADM/health
python3 - "$GW" "$ADM" "$GWPID" "$STREAMS" "$TOKENS" <<'PY'
import asyncio, json, sys, time, urllib.request, os, platform, datetime
gw, adm, pid, n, tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def rss_kib():
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS:"):
            return int(l.split()[1])

def inflight():
    v = json.load(urllib.request.urlopen(f"http://127.0.0.1:{adm}/admin/instances", timeout=5))
    return sum(i["inflight_requests"] for i in v["instances"]), v

body = json.dumps({"model": "m", "stream": True, "max_tokens": tokens,
                   "messages": [{"role": "user", "content": "Tell me a story about load tests."}]}).encode()
req = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
       f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
first = 0
results = {"ok": 0, "status": 0, "truncated": 0, "error": 0}
errors = []

async def one():
    global first
    try:
        r, w = await asyncio.open_connection("127.0.0.1", gw)
        w.write(req); await w.drain()
        buf = b""; got_first = False
        while True:
            d = await r.read(65536)
            if not d:
                break
            buf += d
            if not got_first and b"data:" in buf:
                got_first = True; first += 1
            if len(buf) > 1 << 20:
                buf = buf[-4096:]
        w.close()
        if not buf.startswith(b"HTTP/1.1 200"):
            results["status"] += 1; errors.append(buf[:200])
        elif b"[DONE]" not in buf:
            results["truncated"] += 1
        else:
            results["ok"] += 1
    except Exception as e:
        results["error"] += 1; errors.append(repr(e))

async def main():
    # Warm up (allocator, connection pools), then the idle baseline.
    await asyncio.gather(*[one() for _ in range(50)])
    global first
    for k in results: results[k] = 0
    first = 0
    errors.clear()
    await asyncio.sleep(1)
    idle = rss_kib()
    t0 = time.time()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one()))
        if i % 100 == 99:
            await asyncio.sleep(0.1)   # ~1000 new streams per second
    ramp = time.time() - t0
    # Plateau: every stream has its first chunk; sample RSS and the gateway's in-flight count.
    deadline = time.time() + 60
    while first < n and time.time() < deadline:
        await asyncio.sleep(0.2)
    samples, flights = [], []
    for _ in range(5):
        samples.append(rss_kib())
        flights.append((await asyncio.to_thread(inflight))[0])
        await asyncio.sleep(0.5)
    await asyncio.gather(*tasks)
    total = time.time() - t0
    await asyncio.sleep(1)
    after, table = await asyncio.to_thread(inflight)
    peak = max(samples)
    out = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "streams": n, "tokens_per_stream": tokens, "cores": os.cpu_count(),
        "ok": results["ok"], "bad_status": results["status"], "truncated": results["truncated"],
        "client_errors": results["error"], "streams_with_first_chunk_at_plateau": first,
        "gateway_inflight_at_plateau": flights, "ramp_s": round(ramp, 1), "total_s": round(total, 1),
        "rss_idle_mib": round(idle / 1024, 1), "rss_plateau_mib": round(peak / 1024, 1),
        "rss_after_mib": round(rss_kib() / 1024, 1),
        "kib_per_stream": round((peak - idle) / n, 1),
        "inflight_after": after,
        "instance_errors": sum(i["errors"] for i in table["instances"]),
    }
    print(json.dumps(out, indent=1))
    for e in errors[:5]:
        print("error:", e)
    bad = results["status"] + results["truncated"] + results["error"] + after
    sys.exit(1 if bad else 0)

asyncio.run(main())
PY
