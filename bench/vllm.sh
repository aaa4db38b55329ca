#!/usr/bin/env bash
# The real-engine row (issue 33): the multi-tenant agentic load, scaled down, against two real
# vLLM servers (the CPU build serving the tiny random-weight model of scripts/vllm/setup.sh,
# one core each) behind tokengate's default, smg cache_aware and round-robin, in the same
# run. The judge is the engines' own prefix cache: vLLM's vllm:prefix_cache_hits_total /
# vllm:prefix_cache_queries_total over each run (and the cached_tokens of its answers, which
# the load generator's report sums). Timing on CPU is not the point (the tiny model's
# prefill is fast and the engines share two cores with the router and the load generator);
# TTFT is shown but the cache behaviour is what is real.
#
# Both engines are started once and their caches reset (/reset_prefix_cache) before every
# run, so every config starts cold. Configs:
#   tg-default       tokengate, the service says nothing about scheduling (its default)
#   tg-layered       tokengate `scheduler: {mode: layered}`
#   tg-default-em, tg-layered-em   the same with `engine_metrics: {cache_size: true}` (the
#                    engines' queues and KV cache size from vLLM's /metrics, as the README
#                    recommends)
#   tg-rr            tokengate `load_balancing: round-robin` (the floor)
#   smg-cache-aware  smg launch --policy cache_aware
#   smg-rr           smg launch --policy round_robin
#
# Usage: bench/vllm.sh   (builds target/release/tokengate first; BUILD=0 skips; BIN=… another binary)
# Knobs: CONFIGS, SEEDS ("1 2 3"), RATE (sessions/s, 1), DURATION (s, 40), TENANTS (6), ZIPF
#   (1.2), SYSTEM_TOKENS (400-900), TURNS (2-5), KV_BLOCKS (each engine's KV cache in 128-token
#   blocks, vLLM's --num-gpu-blocks-override; default: 1 GiB, which holds everything), OUT
#   (target/bench/vllm). Needs: python3, curl,
#   smg (pip install smg) for the smg rows, and scripts/vllm/setup.sh's install (run here).
# Writes OUT/<seed>/<config>/{report.json,vllm.json} and prints one line per run and a table.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CONFIGS=${CONFIGS:-"tg-default tg-layered smg-cache-aware tg-rr"}
SEEDS=${SEEDS:-"1 2 3"}
RATE=${RATE:-1}
DURATION=${DURATION:-40}
TENANTS=${TENANTS:-6}
ZIPF=${ZIPF:-1.2}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-400-900}
TURNS=${TURNS:-2-5}
KV_BLOCKS=${KV_BLOCKS:-}
OUT=${OUT:-target/bench/vllm}
MODEL=tiny
ENGINES=2
BLOCK_SIZE=16

. bench/lib.sh

if [ "${BUILD:-1}" = 1 ]; then cargo build --release --bin tokengate --quiet; fi
BIN=${BIN:-$ROOT/target/release/tokengate}
[ -x "$BIN" ] || { echo "no $BIN (run without BUILD=0)" >&2; exit 1; }
for c in $CONFIGS; do
  case $c in smg-*) command -v smg >/dev/null || { echo "smg missing: pip install smg" >&2; exit 1; };; esac
done
scripts/vllm/setup.sh >/dev/null

# The engines, each in a process group of its own (vLLM starts an engine-core process).
VLLM_PGIDS=()
cleanup_extra() { local g; for g in "${VLLM_PGIDS[@]}"; do kill -s KILL -- "-$g" 2>/dev/null || true; done; }
ENGINE_URLS=()
for i in 1 2; do
  port=$(free_port)
  # shellcheck disable=SC2046 # no flag, or the two words of one
  setsid scripts/vllm/serve.sh "$port" "$((i - 1))" $([ -n "$KV_BLOCKS" ] && echo --num-gpu-blocks-override "$KV_BLOCKS") >"$WORK/vllm$i.log" 2>&1 &
  VLLM_PGIDS+=($!)
  ENGINE_URLS+=("http://127.0.0.1:$port")
done
for i in 1 2; do
  u=${ENGINE_URLS[$((i-1))]}
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null "$u/health" && break
    kill -0 "${VLLM_PGIDS[$((i-1))]}" 2>/dev/null || break
    sleep 0.5
  done
  curl -sf -o /dev/null "$u/health" || { echo "vLLM $i did not start" >&2; tail -30 "$WORK/vllm$i.log" >&2; exit 1; }
done
echo "vLLM up: ${ENGINE_URLS[*]}" >&2
mkdir -p "$OUT"
for u in "${ENGINE_URLS[@]}"; do curl -sf "$u/metrics" | grep '^vllm:cache_config_info' ; done >"$OUT/cache_config.txt" || true

# vLLM's own prefix-cache counters, summed over both engines: "hits queries".
vllm_counters() {
  local u h=0 q=0 v
  for u in "${ENGINE_URLS[@]}"; do
    v=$(curl -sf "$u/metrics" | awk '/^vllm:prefix_cache_hits_total[{ ]/ {h+=$NF} /^vllm:prefix_cache_queries_total[{ ]/ {q+=$NF} END {printf "%d %d", h, q}')
    h=$((h + ${v% *})); q=$((q + ${v#* }))
  done
  echo "$h $q"
}

mkdir -p "$OUT"
WL_FLAGS="--agentic --tenants $TENANTS --zipf $ZIPF --system-tokens $SYSTEM_TOKENS --user-tokens 32-96 --output-tokens 4-8 --one-shot 0.1 --turns $TURNS --think-time 200ms --think-time-max 1s --header-share 0.5 --engine-block-size $BLOCK_SIZE --duration ${DURATION}s --drain-timeout 30s"
printf 'engines: 2 x vLLM 0.32 CPU, tiny model, KV blocks %s\nworkload: %s --rate %s\n' "${KV_BLOCKS:-1GiB}" "$WL_FLAGS" "$RATE" >"$OUT/flags.txt"

for seed in $SEEDS; do
  for name in $CONFIGS; do
    dir=$OUT/s$seed/$name; rm -rf "$dir"; mkdir -p "$dir"
    for u in "${ENGINE_URLS[@]}"; do curl -sf -X POST -o /dev/null "$u/reset_prefix_cache"; done
    case $name in
      tg-default) start_tokengate ""; url=$GW_URL;;
      tg-layered) start_tokengate "    scheduler: { mode: layered }"; url=$GW_URL;;
      tg-default-em) start_tokengate "    engine_metrics: { interval: 1s, cache_size: true }"; url=$GW_URL;;
      tg-layered-em) start_tokengate "    scheduler: { mode: layered }
    engine_metrics: { interval: 1s, cache_size: true }"; url=$GW_URL;;
      tg-rr) start_tokengate "    load_balancing: round-robin"; url=$GW_URL;;
      smg-*)
        p=${name#smg-}; [ "$p" = rr ] && p=round_robin; p=${p//-/_}
        start_smg "$p"; url=$SMG_URL;;
      *) echo "unknown config $name" >&2; exit 1;;
    esac
    before=$(vllm_counters)
    # shellcheck disable=SC2086 # WL_FLAGS is a list of flags
    "$BIN" bench replay --model "$MODEL" --url "$url" $WL_FLAGS --seed "$seed" --rate "$RATE" \
      --out-json "$dir/report.json" >/dev/null 2>"$dir/replay.log" || echo "   replay failed (exit $?), see $dir/replay.log" >&2
    after=$(vllm_counters)
    if [ -n "$GW_PID" ]; then
      curl -sf "$GW_ADMIN/admin/instances" >"$dir/instances.json" || true
      stop "$GW_PID"; GW_PID=
    fi
    if [ -n "$SMG_PID" ]; then stop "$SMG_PID"; SMG_PID=; fi
    python3 - "$dir" "$before" "$after" <<'PY'
import json, sys
d, b, a = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
hits, queries = int(a[0]) - int(b[0]), int(a[1]) - int(b[1])
r = json.load(open(d + "/report.json"))
out = {"vllm_hits": hits, "vllm_queries": queries, "vllm_hit_ratio": hits / queries if queries else None}
json.dump(out, open(d + "/vllm.json", "w"))
c, s, k = r["counts"], r["ttft_ms"], r["tokens"]
print("%-16s ok %d/%d  vLLM prefix hit %.3f (%d/%d tokens)  usage cached %.3f (ideal %.3f)  TTFT p50 %.0f p99 %.0f ms" % (
    d.split("/")[-1], c["ok"], c["sent"], out["vllm_hit_ratio"] or 0, hits, queries,
    k["cached_ratio"], k.get("ideal_token_hit_ratio") or 0, s["p50"], s["p99"]), file=sys.stderr)
PY
  done
done

python3 - "$OUT" "$SEEDS" "$CONFIGS" <<'PY'
import json, statistics, sys
out, seeds, configs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
print("| config | vLLM prefix hit ratio, per seed | median | TTFT p50 / p99 ms (median) | ok |")
print("|---|---|---|---|---|")
for c in configs:
    hs, p50, p99, ok = [], [], [], []
    for s in seeds:
        try:
            v = json.load(open(f"{out}/s{s}/{c}/vllm.json")); r = json.load(open(f"{out}/s{s}/{c}/report.json"))
        except OSError:
            continue
        hs.append(v["vllm_hit_ratio"] or 0); p50.append(r["ttft_ms"]["p50"]); p99.append(r["ttft_ms"]["p99"])
        ok.append("%d/%d" % (r["counts"]["ok"], r["counts"]["sent"]))
    if hs:
        print("| %s | %s | %.3f | %.0f / %.0f | %s |" % (c, " · ".join("%.3f" % h for h in hs), statistics.median(hs),
              statistics.median(p50), statistics.median(p99), " · ".join(ok)))
PY
