#!/usr/bin/env bash
# Memory per open stream and per idle connection of the gateway, black-box (issue 27 item 4).
#
# Usage: [BIN=target/release/tokengate] [SCHED=default|least-request] [PROMPT_BYTES=40]
#        [GW_ENV="env VAR=…"] bench/memory.sh [STREAMS=3000] [IDLE=3000]
#   Three phases, each on a fresh gateway process (so one phase's freed memory does not feed
#   the next): STREAMS streaming chat requests held open at once by a slow engine-sim (one
#   token a second), IDLE keep-alive connections idle after one answered request, and IDLE
#   connections that sent nothing yet. Per phase: VmRSS after a 50-request warm-up (idle
#   baseline), VmRSS with every stream/connection open (5 samples once all are open, the
#   highest), and (plateau - baseline) / count.
#   PROMPT_BYTES: the prompt's length (real prompts are KBs: the body is kept while a stream runs).
#   SCHED=default leaves the service without a scheduler key (the layered default of a
#   multi-instance service); least-request is plain balancing as bench/load.sh uses.
# Output: one JSON line per phase on stdout. Needs python3 (stdlib only). Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-3000}; IDLE=${2:-3000}; SIMS=${SIMS:-2}; SCHED=${SCHED:-default}
BIN=${BIN:-target/release/tokengate}
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release -p tokengate" >&2; exit 1; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
need=$((STREAMS * 2 + IDLE + 1000))
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$need" ]; then
  echo "ulimit -n is $(ulimit -n); this run needs about $need descriptors" >&2; exit 1
fi
. bench/lib.sh
INST=""
for i in $(seq 1 "$SIMS"); do
  RUST_LOG=warn "$BIN" engine-sim --listen 127.0.0.1:0 --id "e$i" --model m --max-running 100000 \
    --kv-blocks 2000000 --decode-step-ms 1000 --decode-per-req-ms 0 --chunk-tokens 1 \
    >/dev/null 2>"$WORK/e$i.log" &
  PIDS+=($!)
done
for i in $(seq 1 "$SIMS"); do
  URL=$(wait_line "$WORK/e$i.log" 'listening on http://'); wait_http "$URL/health"
  INST+="      - { id: e$i, addr: \"${URL#http://}\" }"$'\n'
done
LB=""; [ "$SCHED" = default ] || LB="    load_balancing: $SCHED"

phase() {
  local mode=$1 count=$2 gw adm
  cat >"$WORK/gw.yaml" <<YAML
listen: ["127.0.0.1:0"]
admin_listen: "127.0.0.1:0"
threads: 2
services:
  - name: m
$LB
    instances:
$INST
YAML
  : >"$WORK/gw.out" # emptied before the start: wait_line must not read the previous run's address
  RUST_LOG=warn ${GW_ENV:-} "$BIN" serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
  local gwpid=$!; PIDS+=($gwpid)
  gw=$(wait_line "$WORK/gw.out" 'proxy listening on http://'); gw=${gw##*:}
  adm=$(wait_line "$WORK/gw.out" 'admin listening on http://'); adm=${adm##*:}
  wait_http "http://127.0.0.1:$adm/health"
  python3 - "$mode" "$gw" "$adm" "$gwpid" "$count" "${PROMPT_BYTES:-40}" <<'PY'
import asyncio, json, sys, time, urllib.request
mode, gw, adm, pid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
prompt = ("Tell me a story about load tests. " * (int(sys.argv[6]) // 34 + 1))[:int(sys.argv[6])]

def rss_kib():
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS:"):
            return int(l.split()[1])

def inflight():
    v = json.load(urllib.request.urlopen(f"http://127.0.0.1:{adm}/admin/instances", timeout=10))
    return sum(i["inflight_requests"] for i in v["instances"])

def request(stream, max_tokens, close):
    body = json.dumps({"model": "m", "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{'connection: close' if close else 'connection: keep-alive'}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body

opened = 0
release = asyncio.Event()

async def one_stream(tokens):
    # A stream of `tokens` tokens (one a second); counts itself open at its first chunk.
    global opened
    r, w = await asyncio.open_connection("127.0.0.1", gw)
    w.write(request(True, tokens, True)); await w.drain()
    buf, counted = b"", False
    while True:
        d = await r.read(65536)
        if not d:
            break
        buf = (buf + d)[-4096:]
        if not counted and b"data:" in buf:
            counted = True; opened += 1
    w.close()
    return b"[DONE]" in buf

async def one_idle(keepalive):
    # A connection that got one answer and stays open (keep-alive), or never sent a byte.
    global opened
    r, w = await asyncio.open_connection("127.0.0.1", gw)
    if keepalive:
        w.write(request(False, 1, False)); await w.drain()
        head = b""
        while b"\r\n\r\n" not in head:
            d = await r.read(65536)
            if not d:
                raise RuntimeError("closed before the answer")
            head += d
        length = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0])
        body = head.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += await r.read(65536)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head[:100])
    opened += 1
    await release.wait()
    w.close()
    return True

async def main():
    global opened
    # Warm-up (allocator, upstream connection pools), then the baseline.
    await asyncio.gather(*[one_stream(2) for _ in range(50)])
    opened = 0
    await asyncio.sleep(1)
    base = rss_kib()
    t0 = time.time()
    tasks = []
    for i in range(n):
        if mode == "streams":
            tasks.append(asyncio.create_task(one_stream(30)))
        else:
            tasks.append(asyncio.create_task(one_idle(mode == "keepalive")))
        if i % 100 == 99:
            await asyncio.sleep(0.1)
    deadline = time.time() + 50
    while opened < n and time.time() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1)
    samples = []
    for _ in range(5):
        samples.append(rss_kib()); await asyncio.sleep(0.3)
    flight = await asyncio.to_thread(inflight)
    release.set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    ok = sum(1 for d in done if d is True)
    peak = max(samples)
    print(json.dumps({"phase": mode, "count": n, "prompt_bytes": len(prompt), "open_at_plateau": opened, "gateway_inflight": flight,
                      "completed_ok": ok, "rss_base_mib": round(base / 1024, 1),
                      "rss_plateau_mib": round(peak / 1024, 1),
                      "kib_each": round((peak - base) / n, 1), "open_s": round(time.time() - t0, 1)}))
    sys.exit(0 if ok == n and opened == n else 1)

asyncio.run(main())
PY
  stop "$gwpid"
}
phase streams "$STREAMS"
phase keepalive "$IDLE"
phase fresh "$IDLE"
