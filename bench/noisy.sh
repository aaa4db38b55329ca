#!/usr/bin/env bash
# Noisy neighbour (issue 31): one tenant floods a throttled fleet while three interactive
# tenants send a request now and then; the interactive tenants' TTFT p50/p99 with the
# throttling queue in FIFO order, with fair queueing over tenants, and with fair queueing
# plus priority classes. Same keys, same load, same engines in all three:
#   fifo      every key in `api_keys` (one tenant: the queue is first come, first served)
#   fair      four tenants of the same class (start-time fair queueing by tokens)
#   priority  the same four tenants, the noisy one `batch`, the others `interactive`
# Engines: ENGINES engine-sims (prefill 8k tok/s, 6 ms + 0.35 ms/request steps); throttling
# `{overflow: queue, total: SLOTS}` per engine, so the gateway's queue decides who goes next.
# Load (python3, stdlib only): the noisy tenant keeps NOISY streams in flight (closed loop,
# max_tokens 64 — about five times its fair quarter of the fleet); each interactive tenant
# sends one stream (max_tokens 16) every 1/RATE s on average (Poisson arrivals). TTFT = time
# to the first SSE event that carries content. The first WARM seconds are not counted.
# Usage: [BIN=target/release/tokengate] [MODES="fifo fair priority"] [DURATION=40] [WARM=5] [NOISY=40] [RATE=1]
#        [ENGINES=2] [SLOTS=4] [SEED=1] bench/noisy.sh
# Output: a table on stdout (the numbers in bench/results/tenants.md come from it).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/tokengate}
DURATION=${DURATION:-40}; WARM=${WARM:-5}; NOISY=${NOISY:-40}; RATE=${RATE:-1}
ENGINES=${ENGINES:-2}; SLOTS=${SLOTS:-4}; SEED=${SEED:-1}
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release -p tokengate" >&2; exit 1; }
. bench/lib.sh

run_mode() { # $1 = fifo | fair | priority
  local mode=$1 inst="" i url
  local sims=()
  for i in $(seq 1 "$ENGINES"); do
    RUST_LOG=warn "$BIN" engine-sim --listen 127.0.0.1:0 --id "e$i" --model m --max-running 64 \
      >/dev/null 2>"$WORK/$mode-e$i.log" &
    PIDS+=($!); sims+=($!)
  done
  for i in $(seq 1 "$ENGINES"); do
    url=$(wait_line "$WORK/$mode-e$i.log" 'listening on http://'); wait_http "$url/health"
    inst+="      - { id: e$i, addr: \"${url#http://}\" }"$'\n'
  done
  local keys
  case $mode in
    fifo) keys='api_keys: [sk-noisy, sk-i1, sk-i2, sk-i3]' ;;
    fair) keys=$'tenants:\n  - { name: noisy, keys: [sk-noisy] }\n  - { name: i1, keys: [sk-i1] }\n  - { name: i2, keys: [sk-i2] }\n  - { name: i3, keys: [sk-i3] }' ;;
    priority) keys=$'tenants:\n  - { name: noisy, keys: [sk-noisy], priority: batch }\n  - { name: i1, keys: [sk-i1], priority: interactive }\n  - { name: i2, keys: [sk-i2], priority: interactive }\n  - { name: i3, keys: [sk-i3], priority: interactive }' ;;
  esac
  cat >"$WORK/$mode.yaml" <<YAML
listen: ["127.0.0.1:0"]
admin_listen: "127.0.0.1:0"
timeouts: { first_byte: 120s }
$keys
services:
  - name: m
    load_balancing: least-request
    throttling: { overflow: queue, total: $SLOTS, max_queue: 10000, queue_timeout: 120s }
    instances:
$inst
YAML
  RUST_LOG=warn "$BIN" serve -c "$WORK/$mode.yaml" >"$WORK/$mode.out" 2>"$WORK/$mode.log" &
  local gpid=$!; PIDS+=($gpid)
  local gw adm
  gw=$(wait_line "$WORK/$mode.out" 'proxy listening on http://'); gw=${gw##*:}
  adm=$(wait_line "$WORK/$mode.out" 'admin listening on http://')
  wait_http "$adm/health"
  python3 - "$mode" "$gw" "$DURATION" "$WARM" "$NOISY" "$RATE" "$SEED" <<'PY'
import asyncio, json, random, sys, time
mode, port, duration, warm, noisy, rate, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
rng = random.Random(seed)
words = "the of and to in is was for on that with as by at from his her an were are which this be".split()

def body(max_tokens, n_words):
    text = " ".join(rng.choice(words) for _ in range(n_words))
    return json.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": text}]}).encode()

async def stream(key, max_tokens, n_words):
    """One streamed chat; returns (status, ttft seconds or None)."""
    b = body(max_tokens, n_words)
    t0 = time.monotonic()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
             f"content-type: application/json\r\nconnection: close\r\ncontent-length: {len(b)}\r\n\r\n").encode() + b)
    await w.drain()
    buf, ttft, status = b"", None, None
    while True:
        d = await r.read(65536)
        if not d:
            break
        buf += d
        if status is None and b"\r\n" in buf:
            status = int(buf.split(b" ", 2)[1])
        if ttft is None:
            for line in buf.split(b"\n"):
                if line.startswith(b"data: {"):
                    try:
                        ev = json.loads(line[6:])
                    except ValueError:
                        continue
                    ch = ev.get("choices") or [{}]
                    if (ch[0].get("delta") or {}).get("content"):
                        ttft = time.monotonic() - t0
                        break
        if ttft is not None:
            buf = buf[-64:]
    w.close()
    return status, ttft

start = time.monotonic()
end = start + duration
results = {"noisy": [], "interactive": []}

async def noisy_worker():
    while time.monotonic() < end:
        st, t = await stream("sk-noisy", 64, 300)
        if time.monotonic() - start > warm:
            results["noisy"].append((st, t))

async def interactive(key):
    tasks = []
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.monotonic() >= end:
            break
        sent = time.monotonic()
        async def one(sent=sent):
            st, t = await stream(key, 16, 300)
            if sent - start > warm:
                results["interactive"].append((st, t))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)

async def main():
    await asyncio.gather(*[noisy_worker() for _ in range(noisy)],
                         *[interactive(k) for k in ("sk-i1", "sk-i2", "sk-i3")])

asyncio.run(main())

def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] * 1000 if v else float("nan")

out = {"mode": mode}
for who, rs in results.items():
    ok = [t for st, t in rs if st == 200 and t is not None]
    out[who] = {"requests": len(rs), "ok": len(ok), "p50_ms": round(pct(ok, 0.5)), "p99_ms": round(pct(ok, 0.99)),
                "max_ms": round(max(ok) * 1000) if ok else None}
print(json.dumps(out))
PY
  if ! kill -0 "$gpid" 2>/dev/null; then
    echo "$mode: the gateway exited; its log:" >&2; tail -20 "$WORK/$mode.log" >&2
  fi
  grep -E "ERROR|panicked" "$WORK/$mode.log" | head -5 >&2 || true
  stop "$gpid" "${sims[@]}"
}

echo "# DURATION=$DURATION WARM=$WARM NOISY=$NOISY RATE=$RATE ENGINES=$ENGINES SLOTS=$SLOTS SEED=$SEED $(git rev-parse --short HEAD)"
for mode in ${MODES:-fifo fair priority}; do run_mode "$mode"; done
