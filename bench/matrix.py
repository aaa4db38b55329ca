#!/usr/bin/env python3
"""The workload matrix of issue 34: its cells, what each cell means for the engines and the
load generator, the duration estimate, and each run's summary. bench/matrix.sh drives it.

Subcommands:
  list                         the cells, one line each
  table                        the cells as a markdown table
  names                        the workload cells' names (the default CELLS)
  env CELL                     shell assignments for one cell (sourced by matrix.sh)
  estimate "CELLS" N_SEEDS N_CONFIGS   the estimated wall time of a matrix run, seconds
  summarize DIR                one run's summary.json from its requests, engines and report
  join OUT SRC[:CFG,CFG…]…     one run of several runs' seeds (symbolic links), for a scorecard
                               over more seeds: `join target/bench/matrix/all9 …/s123 …/s456
                               …/s789:tg-nokey,smg-cache-aware`; a seed and config found in
                               two sources is an error

A cell is written in the engines' (simulated) time; the load generator runs in real time, so
the think times are divided by SIM_TIME_SCALE. Every cell sends about REQ_RATE requests per
real second (the machine's budget: load generator, router and engines share 2 cores); the
load factor then sets how fast the engines prefill:

  ideal prefill demand = REQ_RATE x d, d = the uncached tokens of a mean request when every
      prefix is reused (one infinite shared cache): the user message, the previous answer,
      the chat template and the prompt's partial last block;
  fleet prefill capacity = demand / load, split over the engines by their speed (mixed
      fleets: two engines at half the rate), so `overload` (1.3) queues on every router.

The engine cache is a share of the hot working set W (the system prompts of the tenants a
run uses, weighted by the chance it uses them, plus the histories of the sessions alive at
once, by Little's law), per engine: engine-sim's `--cache-tokens` (idle blocks kept for
reuse), with a KV pool (`--kv-blocks`) large enough for a full batch of the largest requests,
so that the cache axis is the prefix cache alone (no request waits for KV room).
"""
import gzip
import json
import math
import os
import sys

# --- the axes ------------------------------------------------------------------------------
TENANTS = {
    # few tenants, the hottest larger than one engine (Zipf 1.2 over 6: ~40 % of the sessions)
    "few": (6, 1.2),
    # many tenants, Zipf 1.1 over 40: the top one ~27 %, the top ten ~73 %
    "many": (40, 1.1),
}
SYSTEM = {"1k": (768, 1280), "4k": (3072, 5120), "12k": (10240, 14336)}
THINK = {  # simulated seconds, turns, user tokens
    "agents": {"think": (0.1, 0.1), "turns": (2, 12), "user": (128, 640)},
    "people": {"think": (1.0, 5.0), "turns": (3, 10), "user": (64, 512)},
    # people who read the answer before they type (check cells only, below)
    "readers": {"think": (8.0, 40.0), "turns": (3, 10), "user": (64, 512)},
}
OUTPUT = (32, 128)
CACHE = {"fifth": 0.2, "half": 0.5, "all": 1.0}
# Share of the fleet's prefill capacity the ideal demand takes. Routing that loses prefixes
# recomputes whole system prompts, so real demand is several times the ideal: the issue's
# own "high" (3 sessions/s of ~6 turns against 4 engines of 10 k tokens/s) is ~0.22, and
# bench/tail.sh's high load ~0.33. Overload is the 1.3: every router queues.
# `busy` (capacity cells only): three engines are over capacity at ideal reuse (1.07), four
# just under it, so the fleet queues when the new or restarted engine is not used.
LOAD = {"moderate": 0.12, "high": 0.25, "overload": 1.3, "busy": 0.8}
ENGINES = {"4eq": [1, 1, 1, 1], "8eq": [1] * 8, "4mixed": [1, 1, 0.5, 0.5]}
PREFILL = {"serial": 0, "chunked": 512}  # engine-sim --prefill-chunk-tokens

# --- the cells (about a dozen, every value of every axis at least once) ---------------------
# name: tenants, system, think, header share, one-shot share, cache, load, engines, prefill
CELLS = {
    # the workload: few tenants with a hot one, 4k prompts, people, half the sessions
    # with a header, 10 % one-shots, small caches, high load
    "few-4k-people-half-high": ("few", "4k", "people", 0.5, 0.1, "fifth", "high", "4eq", "serial"),
    "few-4k-people-all-moderate": ("few", "4k", "people", 0.5, 0.1, "all", "moderate", "4eq", "serial"),
    # bench/tail.sh's workload: many tenants, agents, a quarter one-shots
    "many-4k-agents-fifth-high": ("many", "4k", "agents", 1.0, 0.25, "fifth", "high", "4eq", "serial"),
    "many-4k-nohdr-half-high-chunked": ("many", "4k", "agents", 0.0, 0.25, "half", "high", "4eq", "chunked"),
    "many-1k-agents-half-high-8eq": ("many", "1k", "agents", 1.0, 0.25, "half", "high", "8eq", "serial"),
    "few-1k-agents-nohdr-all-high-8eq": ("few", "1k", "agents", 0.0, 0.3, "all", "high", "8eq", "chunked"),
    "few-12k-agents-half-high": ("few", "12k", "agents", 0.5, 0.1, "half", "high", "4eq", "serial"),
    "few-12k-people-all-moderate-chunked": ("few", "12k", "people", 1.0, 0.1, "all", "moderate", "4eq", "chunked"),
    "many-12k-people-half-high-8eq": ("many", "12k", "people", 0.5, 0.1, "half", "high", "8eq", "serial"),
    "many-4k-agents-half-overload": ("many", "4k", "agents", 1.0, 0.25, "half", "overload", "4eq", "serial"),
    "few-4k-people-half-overload-mixed": ("few", "4k", "people", 0.5, 0.1, "half", "overload", "4mixed", "serial"),
    "many-4k-agents-fifth-high-mixed-chunked": ("many", "4k", "agents", 0.5, 0.25, "fifth", "high", "4mixed", "chunked"),
}
# Capacity cells: the same kind of load, and one event in the fleet (matrix.sh runs them).
#   cap-add:   three engines busy at the high load; a fourth joins (tokengate: the config
#              file gains it and gets SIGHUP; smg: POST /workers) at CAP_AT of the run
#   cap-crash: four engines; one is SIGKILLed at CAP_AT and restarted (same port, cold
#              cache) CAP_DOWN seconds later
CAPACITY = {
    "cap-add": ("few", "4k", "agents", 1.0, 0.1, "half", "busy", "4eq", "serial"),
    "cap-crash": ("few", "4k", "agents", 1.0, 0.1, "half", "busy", "4eq", "serial"),
}
# Check cells: workloads outside the twelve, not used to choose defaults, run by name (CELLS=…)
# to see whether a change made on the twelve holds elsewhere. `readers`' turns come 2–10 s
# apart (real), longer than a turn takes, which the twelve's think times (≤ 1.25 s) never are.
# Run them with DURATION=30 DRAIN=20: readers' sessions then send several turns, and the
# moderate cell has 270-470 requests per seed after the warm-up instead of 66-112 (the 12k
# mixed and the overload check cells take 30-s arrivals and a 40-s drain anyway, like the
# overload cells).
CHECKS = {
    "many-4k-readers-half-high": ("many", "4k", "readers", 0.5, 0.1, "half", "high", "4eq", "serial"),
    # long prompts on engines of two generations (the twelve mix engines with 4k prompts only)
    "few-12k-people-half-high-mixed-chunked": ("few", "12k", "people", 0.5, 0.1, "half", "high", "4mixed", "chunked"),
    # agents in overload with caches that hold every prompt: only the queues decide
    "few-4k-agents-all-overload": ("few", "4k", "agents", 1.0, 0.1, "all", "overload", "4eq", "serial"),
    # short prompts, tiny caches, moderate load, mixed engines
    "many-1k-agents-fifth-moderate-mixed": ("many", "1k", "agents", 1.0, 0.25, "fifth", "moderate", "4mixed", "serial"),
    # API traffic: nine requests in ten are one-shot prompts, no session header, 8 engines
    "many-4k-oneshots-half-high-8eq-chunked": ("many", "4k", "people", 0.0, 0.9, "half", "high", "8eq", "chunked"),
    # the hardest corner: 12k prompts, small caches, overload, engines of two speeds
    "few-12k-agents-fifth-overload-mixed": ("few", "12k", "agents", 1.0, 0.1, "fifth", "overload", "4mixed", "serial"),
}
ALL = {**CELLS, **CAPACITY, **CHECKS}
# The axis names, for the page.
AXES = ("tenants", "system", "think", "header", "one-shot", "cache", "load", "engines", "prefill")

BLOCK = 16
MAX_RUNNING = 64
TEMPLATE = 3  # engine-sim's chat template: "<|role|>\n" ... "\n" per message


def knob(name, default):
    v = os.environ.get(name)
    return type(default)(v) if v not in (None, "") else default


def mean(r):
    return (r[0] + r[1]) / 2


def derive(name):
    """Everything a cell means for the engines and the load generator."""
    tenants_k, sys_k, think_k, header, one_shot, cache_k, load_k, eng_k, prefill_k = ALL[name]
    scale = knob("SIM_TIME_SCALE", 4.0)
    req_rate = knob("REQ_RATE", 12.0)  # real requests/s
    duration = knob("DURATION", 10.0)  # real s of arrivals
    drain = knob("DRAIN", 6.0)
    if name.startswith("cap-"):
        duration = knob("CAP_DURATION", 20.0)
    elif ALL[name][6] == "overload":
        # Closed-loop sessions at 1.3x capacity send few turns each (every turn waits seconds):
        # 10 s gave ~20 requests after the warm-up, so p99 was the maximum of a handful and
        # the drain cut off the last ones (infinite p99 for every router). Longer arrivals and
        # a drain that lets the queues empty make the overload cells' percentiles mean something.
        duration = knob("OVERLOAD_DURATION", 30.0)
        drain = knob("OVERLOAD_DRAIN", 40.0)
    n_tenants, zipf = TENANTS[tenants_k]
    sys_r = SYSTEM[sys_k]
    th = THINK[think_k]
    turns, user = th["turns"], th["user"]
    speeds = list(ENGINES[eng_k])
    load = LOAD[load_k]

    # requests per session, ideal uncached tokens per request
    t_multi = mean(turns)
    t = one_shot + (1 - one_shot) * t_multi
    u, o = mean(user), mean(OUTPUT)
    first = 1 / t  # share of requests that open a session
    d = u + 2 * TEMPLATE + (1 - first) * (o + TEMPLATE + BLOCK / 2)
    cap_real = req_rate * d / load  # real uncached tokens/s of the fleet
    prefill_tps = cap_real / sum(speeds) / scale  # simulated tokens/s of a full-speed engine
    # The longest cold prefill (largest system prompt and message, slowest engine), real s.
    # Where one takes more than 4 s (40 % of the 10-s window: 12k prompts on 8 slow engines)
    # a 10-s run leaves 15-34 requests and the 6-s drain cancels those still queued (∞ for
    # every router): such cells run like the overload cells (30-s arrivals, 40-s drain).
    cold_real = (sys_r[1] + user[1] + 2 * TEMPLATE) / (prefill_tps * min(speeds)) / scale
    long_prefill = not name.startswith("cap-") and load_k != "overload" and cold_real > 4.0
    if long_prefill:
        duration = knob("OVERLOAD_DURATION", 30.0)
        drain = knob("OVERLOAD_DRAIN", 40.0)
    # Sessions arrive from t = 0 and a session sends its turns one cycle apart (think time,
    # decode, a first token), so a short run never reaches the steady state's REQ_RATE: the
    # session rate is raised by the share of the steady state's requests that the window
    # after the warm-up gets (arrivals stop at the end of the run).
    decode_real = o * (6 + 0.35 * 8) / 1000 / scale  # a turn's decode, real s
    think_real = mean(th["think"]) / scale
    cycle = think_real + decode_real + 0.1
    warmup = knob("WARMUP", 2.5)
    p_more = [1.0] + [(1 - one_shot) * max(0.0, min(1.0, (turns[1] - k) / (turns[1] - turns[0] + 1)))
                      for k in range(1, turns[1])]  # P(a session has more than k turns)
    steps = 200
    ts = [warmup + (duration - warmup) * (i + 0.5) / steps for i in range(steps)]
    reached = sum(sum(p_more[k] for k in range(len(p_more)) if k * cycle <= x) for x in ts) / steps
    ramp = min(1.0, reached / t)
    session_rate = req_rate / t / ramp  # real sessions/s

    # hot working set: expected system prompts in use + live session histories
    w = [(k + 1) ** -zipf for k in range(n_tenants)]
    p = [x / sum(w) for x in w]
    n_sessions = session_rate * duration
    w_sys = sum(1 - (1 - pk) ** n_sessions for pk in p) * mean(sys_r)
    lifetime = t_multi * (think_real + decode_real)
    live = session_rate * (1 - one_shot) * lifetime
    w_sess = live * (t_multi / 2) * (u + o + 2 * TEMPLATE)
    hot = w_sys + w_sess
    largest = sys_r[1] + turns[1] * (user[1] + OUTPUT[1] + 2 * TEMPLATE)
    cache = math.ceil(CACHE[cache_k] * hot / BLOCK) * BLOCK
    kv_blocks = math.ceil((cache + MAX_RUNNING * largest) / BLOCK)

    think_lo, think_hi = (x / scale for x in th["think"])
    wl = [
        "--agentic", "--tenants", str(n_tenants), "--zipf", str(zipf),
        "--system-tokens", "%d-%d" % sys_r, "--user-tokens", "%d-%d" % user,
        "--output-tokens", "%d-%d" % OUTPUT, "--one-shot", str(one_shot),
        "--turns", "%d-%d" % turns, "--think-time", "%dms" % round(think_lo * 1000),
        "--header-share", str(header), "--engine-block-size", str(BLOCK),
        "--rate", "%.4f" % session_rate,
    ]
    if think_hi > think_lo:
        wl += ["--think-time-max", "%dms" % round(think_hi * 1000)]
    # ADMIT_AT_PREFILL=1 (the default since matrix run 28): engines that look a waiting
    # request's prefix up when its prefill starts (vLLM, SGLang); 0: when it arrives
    # (engine-sim's default; runs 1-27).
    admit = " --admit-at-prefill" if knob("ADMIT_AT_PREFILL", 1) else ""
    per_engine = []
    for s in speeds:
        per_engine.append(
            "--time-scale %s --kv-blocks %d --cache-tokens %d --block-size %d --prefill-tps %.0f"
            " --max-running %d --prefill-chunk-tokens %d%s"
            % (scale, kv_blocks, cache, BLOCK, prefill_tps * s, MAX_RUNNING, PREFILL[prefill_k],
               admit)
        )
    return {
        "cell": name,
        "axes": dict(zip(AXES, ALL[name])),
        "engines": len(speeds),
        "speeds": speeds,
        "duration_s": duration,
        "drain_s": drain,
        "cold_prefill_real_s": cold_real,
        "long_prefill": long_prefill,
        "session_rate": session_rate,
        "req_rate": req_rate,
        "requests_per_session": t,
        "ramp": ramp,
        "ideal_uncached_per_request": d,
        "prefill_tps": prefill_tps,
        "fleet_prefill_real_tps": cap_real,
        "hot_working_set_tokens": hot,
        "cache_tokens": cache,
        "cache_share": cache / hot,
        "kv_blocks": kv_blocks,
        "largest_request_tokens": largest,
        "wl_flags": wl,
        "sim_flags": per_engine,
    }


def shell_quote(s):
    return "'" + str(s).replace("'", "'\\''") + "'"


def cmd_env(name):
    if name not in ALL:
        sys.exit("unknown cell '%s' (bench/matrix.py list)" % name)
    c = derive(name)
    print("CELL_ENGINES=%d" % c["engines"])
    print("CELL_DURATION=%s" % c["duration_s"])
    print("CELL_DRAIN=%s" % c["drain_s"])
    print("CELL_WL_FLAGS=%s" % shell_quote(" ".join(c["wl_flags"])))
    print("CELL_SIM_FLAGS=(%s)" % " ".join(shell_quote(f) for f in c["sim_flags"]))
    print("CELL_JSON=%s" % shell_quote(json.dumps(c)))


def cmd_list():
    for name in ALL:
        c = derive(name)
        print("%-42s %s | %.1f req/s, prefill %.0f tok/s (sim) per engine, cache %d tokens = %.2f x hot set %d" % (
            name, " ".join(str(v) for v in ALL[name]), c["req_rate"], c["prefill_tps"],
            c["cache_tokens"], c["cache_share"], c["hot_working_set_tokens"]))


def cmd_table():
    print("| cell | tenants | system | think | header share | one-shot | cache | load | engines | prefill |"
          " sessions/s (real) | prefill tok/s per full-speed engine (sim) | cache tokens per engine (share of the hot set) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ALL:
        c = derive(name)
        print("| `%s` | %s | %.2f | %.0f | %s (%.2f) |" % (
            name, " | ".join(str(v) for v in ALL[name]), c["session_rate"], c["prefill_tps"],
            "{:,}".format(c["cache_tokens"]), c["cache_share"]))


def cmd_estimate(cells, n_seeds, n_configs):
    total = 0.0
    for name in cells.split():
        c = derive(name)
        # arrivals + the drain's usual part + starting engines, router and the summary
        per = c["duration_s"] + (c["drain_s"] if c["axes"]["load"] in ("overload", "busy") or c["long_prefill"] else 2.0) + 3.0 + 0.1 * c["engines"]
        total += per * int(n_seeds) * int(n_configs)
    print(int(total))


# --- one run's summary -------------------------------------------------------------------
def quantile(xs, q):
    if not xs:
        return None
    i = min(len(xs) - 1, max(0, math.ceil(len(xs) * q / 100) - 1))
    return xs[i]


def engine_counters(path):
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in d.items() if isinstance(v, dict)}


def fastest_prefill_tps(cell_json):
    """The fastest engine's real prefill rate in a cell, tokens/s (its --prefill-tps × --time-scale)."""
    try:
        flags = json.load(open(cell_json)).get("sim_flags") or []
    except (OSError, ValueError):
        return None
    rates = []
    for f in flags:
        a = f.split()
        get = lambda k, dflt: float(a[a.index(k) + 1]) if k in a else dflt
        rates.append(get("--prefill-tps", 0.0) * get("--time-scale", 1.0))
    return max(rates, default=0.0) or None


def cmd_summarize(d):
    warmup_ms = knob("WARMUP", 2.5) * 1000
    bucket_ms = knob("CAP_BUCKET", 4.0) * 1000
    reqs = []
    path = os.path.join(d, "requests.jsonl.gz")
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            reqs = [json.loads(line) for line in f if line.strip()]
    report = {}
    try:
        report = json.load(open(os.path.join(d, "report.json")))
    except (OSError, ValueError):
        pass
    after = [r for r in reqs if r.get("sent_ms", 0) >= warmup_ms]
    ok = sorted(r["ttft_ms"] for r in after if r.get("error") is None and r.get("ttft_ms") is not None)
    failed = [r for r in after if r.get("error") is not None]
    cancelled = (report.get("counts") or {}).get("cancelled", 0)
    # a failed or cancelled request never got its first token: it counts as an infinite TTFT
    ttft = ok + [math.inf] * (len(failed) + cancelled)
    # the engines' own counters, from the end of the warm-up to the end
    e0, e1 = engine_counters(os.path.join(d, "engines0.json")), engine_counters(os.path.join(d, "engines.json"))
    q = h = 0
    for k, v in e1.items():
        a = e0.get(k) or {}
        dq = v.get("prefix_cache_queries", 0) - a.get("prefix_cache_queries", 0)
        dh = v.get("prefix_cache_hits", 0) - a.get("prefix_cache_hits", 0)
        if dq < 0:  # restarted after a crash: its counters started again
            dq, dh = v.get("prefix_cache_queries", 0), v.get("prefix_cache_hits", 0)
        q, h = q + dq, h + dh
    # requests per engine per bucket (by send time), and the whole run's per-engine counts
    per_bucket = {}
    for r in reqs:
        inst = r.get("instance") or "-"
        b = int(r.get("sent_ms", 0) // bucket_ms)
        per_bucket.setdefault(inst, {}).setdefault(b, 0)
        per_bucket[inst][b] += 1
    n_buckets = 1 + max((b for v in per_bucket.values() for b in v), default=0)
    # Per session (each counted once, whatever its number of turns): the mean TTFT of its
    # turns after the warm-up. Sessions are closed loops, so a router that starves some
    # sessions gets fewer of their (slow) turns into the per-request percentiles; these do not.
    by_session = {}
    for r in after:
        t = r.get("ttft_ms") if r.get("error") is None else None
        by_session.setdefault(r.get("session"), []).append(math.inf if t is None else t)
    per_session = sorted(sum(v) / len(v) for v in by_session.values())
    # The p99 floor: no router answers a tenant's first request before its whole prompt has
    # been prefilled (nothing of it is cached anywhere yet; later requests of the tenant share
    # its system prompt, so they get 0), at the fastest engine's rate. Each request's TTFT is at
    # least its floor, so every percentile of the TTFTs is at least that of the floors: where
    # smg's p99 is under 1.25 x the floor p99, no router can be 20 % ahead of it there.
    rate = fastest_prefill_tps(os.path.join(d, os.pardir, os.pardir, "cell.json"))
    seen, floors = set(), []
    for r in sorted(reqs, key=lambda r: r.get("sent_ms", 0)):
        first = r.get("turn") == 0 and r.get("tenant") not in seen
        seen.add(r.get("tenant"))
        if r.get("sent_ms", 0) >= warmup_ms:
            floors.append(r.get("prompt_tokens", 0) * 1000 / rate if first and rate else 0.0)
    floors = sorted(floors + [0.0] * cancelled)
    summary = {
        "sent_after_warmup": len(after),
        "ok_after_warmup": len(ok),
        "failed_after_warmup": len(failed),
        "cancelled": cancelled,
        "p50": quantile(ttft, 50),
        "p90": quantile(ttft, 90),
        "p99": quantile(ttft, 99),
        "p99_floor": quantile(floors, 99),
        "sessions": len(per_session),
        "session_mean_ttft_p50": quantile(per_session, 50),
        "session_mean_ttft_p90": quantile(per_session, 90),
        "cached": h / q if q else None,
        "engine_prompt_tokens": q,
        "dispatch_lag_p99": (report.get("dispatch_lag_ms") or {}).get("p99"),
        "bucket_s": bucket_ms / 1000,
        "per_engine_per_bucket": {k: [v.get(b, 0) for b in range(n_buckets)] for k, v in sorted(per_bucket.items())},
        "peak_inflight": {i["instance"]: i.get("peak_inflight") for i in report.get("instances") or []},
    }
    json.dump(summary, open(os.path.join(d, "summary.json"), "w"), indent=1, default=str)
    fmt = lambda v: "inf" if v == math.inf else ("-" if v is None else "%.0f" % v)
    print("   %d/%d ok after the %g-s warm-up (+%d cancelled), TTFT p50 %s p90 %s p99 %s ms, engine-cached %s, lag p99 %s ms" % (
        len(ok), len(after), warmup_ms / 1000, cancelled, fmt(summary["p50"]), fmt(summary["p90"]), fmt(summary["p99"]),
        "-" if summary["cached"] is None else "%.1f %%" % (100 * summary["cached"]), fmt(summary["dispatch_lag_p99"])),
        file=sys.stderr)


def cmd_join(out, sources):
    """OUT/<cell>/s<seed>/<config> → the source run's directory, for every source's cells,
    seeds and (with `:CFG,CFG`) chosen configs; OUT/command.txt and build.txt name them all."""
    if os.path.exists(out):
        sys.exit("join: %s exists; pick a new name" % out)
    made, commands, builds = 0, [], []
    for src in sources:
        path, _, only = src.partition(":")
        keep = set(only.split(",")) if only else None
        if not os.path.isdir(path):
            sys.exit("join: %s is not a run directory" % path)
        for cell in sorted(os.listdir(path)):
            cj = os.path.join(path, cell, "cell.json")
            if not os.path.isfile(cj):
                continue
            os.makedirs(os.path.join(out, cell), exist_ok=True)
            if not os.path.exists(os.path.join(out, cell, "cell.json")):
                os.symlink(os.path.abspath(cj), os.path.join(out, cell, "cell.json"))
            for seed in sorted(os.listdir(os.path.join(path, cell))):
                sd = os.path.join(path, cell, seed)
                if not (seed.startswith("s") and seed[1:].isdigit() and os.path.isdir(sd)):
                    continue
                for cfg in sorted(os.listdir(sd)):
                    if keep is not None and cfg not in keep:
                        continue
                    dst = os.path.join(out, cell, seed, cfg)
                    if os.path.lexists(dst):
                        sys.exit("join: %s %s %s is in %s and in %s" % (
                            cell, seed, cfg, os.path.realpath(dst).split(os.sep + cell)[0], path))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    os.symlink(os.path.abspath(os.path.join(sd, cfg)), dst)
                    made += 1
        for name, acc in (("command.txt", commands), ("build.txt", builds)):
            f = os.path.join(path, name)
            if os.path.exists(f):
                acc.append(open(f).read().split("\n")[0].strip() if name == "build.txt" else open(f).read().strip())
    if not made:
        sys.exit("join: no seeds found in %s" % " ".join(sources))
    with open(os.path.join(out, "command.txt"), "w") as f:
        f.write("\n".join(commands + ["python3 bench/matrix.py join %s %s" % (out, " ".join(sources))]) + "\n")
    with open(os.path.join(out, "build.txt"), "w") as f:
        f.write("+".join(dict.fromkeys(b.split()[0] for b in builds if b)) + "\n")
    print("joined %d runs of %d sources into %s" % (made, len(sources), out), file=sys.stderr)


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    cmd = argv[1]
    if cmd == "list":
        cmd_list()
    elif cmd == "table":
        cmd_table()
    elif cmd == "names":
        print(" ".join(CELLS))
    elif cmd == "env" and len(argv) == 3:
        cmd_env(argv[2])
    elif cmd == "estimate" and len(argv) == 5:
        cmd_estimate(argv[2], argv[3], argv[4])
    elif cmd == "summarize" and len(argv) == 3:
        cmd_summarize(argv[2])
    elif cmd == "join" and len(argv) >= 4:
        cmd_join(argv[2], argv[3:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
