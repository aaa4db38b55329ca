#!/usr/bin/env python3
"""bench/tail.sh's report: reads the per-run results under OUT and writes MD (one table per
load: every run, then medians and spread across seeds per config, and how each config fares
against smg cache_aware in the same run) and the plots (through the tail-plot binary).

Usage: tail_report.py OUT MD "LOADS" "SEEDS" "CONFIGS"; environment: SIM_FLAGS, WL_FLAGS,
ENGINES, CMD, WALL, PLOT (the tail-plot binary), PLOTS (where the SVGs go, default OUT;
bench/tail.sh sets bench/results/tail); a load's rate is read from its reports.
"""
import json
import os
import re
import statistics
import subprocess
import sys

out, md = sys.argv[1], sys.argv[2]
loads, seeds, configs = (a.split() for a in sys.argv[3:6])
ENGINES = int(os.environ.get("ENGINES", "4"))
REF = "smg-cache-aware"


def beats_all(a, b):
    """Whether run `a` beat run `b` on TTFT p50, p90, p99 (lower) and the cached ratio (higher)."""
    return a["p50"] < b["p50"] and a["p90"] < b["p90"] and a["p99"] < b["p99"] and a["cached"] > b["cached"]


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prom(path):
    """name -> list of (labels dict, value) from a Prometheus text file."""
    m = {}
    if not os.path.exists(path):
        return m
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        g = re.match(r"^([A-Za-z_:][\w:]*)(\{(.*)\})?\s+(\S+)$", line)
        if not g:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', g.group(3) or ""))
        m.setdefault(g.group(1), []).append((labels, float(g.group(4))))
    return m


def label_of(config):
    p = os.path.join("bench/tail", config + ".yaml")
    if os.path.exists(p):
        for line in open(p):
            if line.startswith("# label:"):
                return line.split(":", 1)[1].strip()
    if config == "smg-rr":
        return "smg round_robin"
    if config.startswith("smg-"):
        return "smg " + config[4:].replace("-", "_")
    if config == "direct-rr":
        return "client round-robin, no gateway"
    return config


def run(load, seed, config):
    d = os.path.join(out, load, f"s{seed}", config)
    r = read_json(os.path.join(d, "report.json"))
    if r is None:
        return None
    c, t, k = r["counts"], r["ttft_ms"], r["tokens"]
    per = [i["requests"] for i in r["instances"] if i["instance"] != "-"]
    per += [0] * max(0, ENGINES - len(per))
    mean = statistics.mean(per) if per else 0
    cv = statistics.pstdev(per) / mean if mean else float("nan")
    # imbalance over the whole fleet (engines that got nothing count as 0), like compare.sh
    rows = [row for n, row in zip(r["load"]["instances"], r["load"]["inflight"]) if n != "-"]
    ratios = []
    if rows:
        n = max(ENGINES, len(rows))
        for b in range(len(rows[0])):
            col = [row[b] for row in rows]
            if sum(col) > 0:
                ratios.append(max(col) / (sum(col) / n))
    m = prom(os.path.join(d, "gateway.metrics.txt"))
    gw = {lab.get("kind"): v for lab, v in m.get("tokengate_prefix_hit_ratio", [])}
    decisions = {lab.get("reason"): int(v) for lab, v in m.get("tokengate_routing_decisions_total", [])}
    eng = read_json(os.path.join(d, "engines.json")) or {}
    evicted = sum((e or {}).get("evicted_blocks", 0) for e in eng.values())
    peak_prefill = max([(e or {}).get("max_prefill_phase", 0) for e in eng.values()] or [0])
    ideal = k.get("ideal_token_hit_ratio")
    errors = dict(r["errors"])
    if c["cancelled"]:
        errors["cancelled"] = c["cancelled"]
    return {
        "r": r, "sent": c["sent"], "ok": c["ok"], "failed": c["failed"] + c["cancelled"], "errors": errors,
        "mean": t["mean"], "p50": t["p50"], "p90": t["p90"], "p99": t["p99"],
        "cached": k["cached_ratio"], "ideal": ideal, "of_ideal": k["cached_ratio"] / ideal if ideal else None,
        "per": per, "cv": cv, "imbalance": sum(ratios) / len(ratios) if ratios else 1.0,
        "gw": gw, "decisions": decisions, "evicted": evicted, "peak_prefill": peak_prefill,
        "lag99": r["dispatch_lag_ms"]["p99"], "ttft": read_json(os.path.join(d, "ttft_ms.json")) or [],
        "wait": read_json(os.path.join(d, "wait_ms.json")),
        "wall": (open(os.path.join(d, "wall_s.txt")).read().strip() if os.path.exists(os.path.join(d, "wall_s.txt")) else "?"),
    }


R = {(l, s, c): run(l, s, c) for l in loads for s in seeds for c in configs}
present = [v for v in R.values() if v]
if not present:
    sys.exit(f"no results under {out}")
first = present[0]["r"]
meta, mach = first["meta"], first["meta"]["machine"]


def rate(load):
    v = next((R[(load, s, c)] for s in seeds for c in configs if R[(load, s, c)]), None)
    r = v and v["r"]["meta"]["workload_params"].get("rate")
    return f"{r:g}" if r is not None else os.environ.get("RATE_" + load.upper(), "?")


def ms(x):
    return "–" if x is None else f"{x:,.0f}"


def pct(x):
    return "–" if x is None else f"{x * 100:.1f} %"


def ratio(x):
    return "–" if x is None else f"{x:.2f}"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs, f):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f(xs[0])
    return f"{f(statistics.median(xs))} [{f(min(xs))}–{f(max(xs))}]"


def gw_cell(v):
    g = v["gw"]
    if not g:
        return "–"
    return " / ".join(pct(g.get(k)) for k in ("ceiling", "predicted", "engine"))


def err_cell(v):
    if not v["failed"] and v["ok"] == v["sent"]:
        return "0"
    return f"{v['failed']} (" + ", ".join(f"{k} {n}" for k, n in sorted(v["errors"].items())) + ")"


smgv = sh("smg --version 2>&1 | head -1") or "?"
rustc = sh("rustc --version") or "?"
build = open(os.path.join(out, "build.txt")).read().splitlines() if os.path.exists(os.path.join(out, "build.txt")) else []
commit = (build[0] if build else "") or "?"
dirty = len(build) > 1 and build[1].strip()
wall = int(os.environ.get("WALL", "0"))
plots_dir = os.environ.get("PLOTS") or out  # the SVGs: next to MD (bench/results/tail), not in OUT
os.makedirs(plots_dir, exist_ok=True)
rel = os.path.relpath(plots_dir, os.path.dirname(md) or ".")

L = []
w = L.append
w("# TTFT tail on a multi-tenant agentic workload: tokengate vs smg (issue 12)")
w("")
w(f"Generated by `bench/tail.sh` (first run started {meta['started_at']}). Machine: {mach['nproc']} cores "
  f"({mach.get('cpu_model') or '?'}), {(mach.get('mem_total_bytes') or 0) / 2**30:.1f} GiB RAM, {mach.get('kernel') or '?'}; "
  f"tokengate {meta['tokengate_version']} at commit {commit}{' (with uncommitted changes)' if dirty else ''} "
  f"(release build, {rustc}); {smgv}. The load generator, the router and the {ENGINES} engines share these "
  f"{mach['nproc']} cores; every router runs alone (one run at a time).")
w("")
w(f"Command: `{os.environ.get('CMD', '?')}`" + (f" — total wall time {wall // 60} min {wall % 60} s." if wall else "."))
w("")
wl = os.environ.get("WL_FLAGS", "?")
rates = ", ".join(f"{l}: `--rate {rate(l)}`" for l in loads)
w(f"Workload (`tokengate bench replay`, the same for every router; seeds {', '.join(seeds)}): `{wl}` with {rates} "
  f"sessions/s. Engines: a fresh fleet of {ENGINES} `tokengate engine-sim` processes per run (cold KV caches): "
  f"`{os.environ.get('SIM_FLAGS', '?')}`. Routers: tokengate with `threads: 2`, `prefix_index.block_size: 16`, "
  f"the service keys of `bench/tail/<config>.yaml`; smg `launch --policy P` with its defaults otherwise.")
w("")
for l in loads:
    plans = []
    for s in seeds:
        v = next((R[(l, s, c)] for c in configs if R[(l, s, c)]), None)
        if v:
            p = v["r"]["meta"]["workload_params"].get("plan", {})
            plans.append(f"seed {s}: {p.get('sessions')} sessions ({p.get('one_shot_sessions')} one-shot, "
                         f"{p.get('mean_turns', 0):.1f} turns on average otherwise), {p.get('requests')} requests "
                         f"planned, {p.get('tenants_used')} tenants used, top tenant {p.get('top_tenant_share', 0) * 100:.0f} % of sessions")
    w(f"Plan at the {l} load — " + "; ".join(plans) + ".")
    w("")
w("Columns: **sent** = requests sent (later turns depend on earlier answers, so a slower router sends fewer), **ok**; "
  "TTFT over successful requests (ms, nearest rank); **cached** = Σ cached_tokens / Σ prompt_tokens as the engines "
  "reported them; **ideal** = the run's ceiling, the share of prompt tokens one infinite cache shared by all engines "
  "would have served (`bench/src/ideal.rs`); **÷ ideal** = cached ÷ ideal; **req/engine** = requests per engine, min–max "
  f"(coefficient of variation); **imbalance** = mean over 100 ms buckets of the busiest engine's in-flight ÷ the mean "
  f"over all {ENGINES} (client view, 1.0 = even); **gw** = tokengate's own `tokengate_prefix_hit_ratio` "
  "ceiling / predicted / engine (best instance by its prefix index, the chosen instance, what the engines reported) "
  "scraped from the admin `/metrics`; **evicted** = KV blocks the engines evicted; **peak prefill** = the most "
  "requests one engine had in their prefill phase at once, queued or prefilling (both from engine-sim's `/admin/stats`); "
  "**wait** p50 / p90 / p99 = per request, TTFT less its own prefill (the uncached tokens the engine reported at the "
  "engines' prefill rate): the time spent behind other work, the part of the TTFT routing decides once the cache hits "
  "are given.")
w("")
for l in loads:
    w(f"## {l} load: {rate(l)} sessions/s")
    w("")
    w(f"![TTFT p50/p90/p99 per config and seed]({rel}/{l}-ttft.svg) ![TTFT tail per config]({rel}/{l}-tail.svg)")
    w("")
    w("| config | seed | sent | ok | TTFT mean | p50 | p90 | p99 | wait p50 / p90 / p99 | cached | ideal | ÷ ideal | req/engine (CV) | imbalance | gw ceiling / predicted / engine | evicted | peak prefill | errors |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---|")
    for c in configs:
        for s in seeds:
            v = R[(l, s, c)]
            if not v:
                w(f"| {c} | {s} | no result ||||||||||||||||")
                continue
            wt = v["wait"]
            wait = " / ".join(ms(wt[k]) for k in ("p50", "p90", "p99")) if wt else "–"
            w(f"| {c} | {s} | {v['sent']} | {v['ok']} | {ms(v['mean'])} | {ms(v['p50'])} | {ms(v['p90'])} | {ms(v['p99'])} | {wait} | "
              f"{pct(v['cached'])} | {pct(v['ideal'])} | {ratio(v['of_ideal'])} | {min(v['per'])}–{max(v['per'])} ({v['cv']:.2f}) | "
              f"{v['imbalance']:.2f} | {gw_cell(v)} | {v['evicted']:,} | {v['peak_prefill']} | {err_cell(v)} |")
    w("")
    w(f"Across seeds (median [min–max]); **vs {REF}** counts the seeds where the config beat {REF} *in the same run* "
      "(lower TTFT p50, p90, p99; higher cached ratio; exact figures, not the rounded ones above), and **all four** "
      "the seeds where it beat it on the four at once:")
    w("")
    w(f"| config | runs | TTFT p50 | p90 | p99 | mean | cached ÷ ideal | req CV | imbalance | vs {REF}: p50 · p90 · p99 · cached | all four |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for c in configs:
        vs = [R[(l, s, c)] for s in seeds if R[(l, s, c)]]
        if not vs:
            continue
        col = lambda key: [v[key] for v in vs]  # noqa: E731
        wins, allfour = "–", "–"
        if c != REF and REF in configs:
            pairs = [(R[(l, s, c)], R[(l, s, REF)]) for s in seeds if R[(l, s, c)] and R[(l, s, REF)]]
            every = [s for s in seeds if R[(l, s, c)] and R[(l, s, REF)] and beats_all(R[(l, s, c)], R[(l, s, REF)])]
            if pairs:
                allfour = f"{len(every)}/{len(pairs)}" + (f" (seed{'s' if len(every) > 1 else ''} {', '.join(every)})" if every else "")
                n = len(pairs)
                cnt = lambda f: sum(1 for a, b in pairs if f(a, b))  # noqa: E731
                wins = " · ".join([
                    f"{cnt(lambda a, b: a['p50'] < b['p50'])}/{n}",
                    f"{cnt(lambda a, b: a['p90'] < b['p90'])}/{n}",
                    f"{cnt(lambda a, b: a['p99'] < b['p99'])}/{n}",
                    f"{cnt(lambda a, b: a['cached'] > b['cached'])}/{n}",
                ])
        w(f"| {label_of(c)} | {len(vs)} | {spread(col('p50'), ms)} | {spread(col('p90'), ms)} | {spread(col('p99'), ms)} | "
          f"{spread(col('mean'), ms)} | {spread(col('of_ideal'), ratio)} | {spread(col('cv'), ratio)} | "
          f"{spread(col('imbalance'), ratio)} | {wins} | {allfour} |")
    w("")
    # routing decisions of the tokengate rows (first seed)
    dec = []
    for c in configs:
        v = next((R[(l, s, c)] for s in seeds if R[(l, s, c)]), None)
        if v and v["decisions"]:
            dec.append(f"{c}: " + ", ".join(f"{k} {n}" for k, n in sorted(v["decisions"].items(), key=lambda kv: -kv[1])))
    if dec:
        w("tokengate routing decisions (`tokengate_routing_decisions_total`, seed " + seeds[0] + "): " + "; ".join(dec) + ".")
        w("")
    lags = [v["lag99"] for v in (R[(l, s, c)] for s in seeds for c in configs) if v]
    w(f"Client dispatch lag p99 over these runs: {min(lags):.1f}–{max(lags):.1f} ms (the load generator kept up when "
      "this stays small).")
    w("")

    # plots
    plot = os.environ.get("PLOT")
    if plot and os.path.exists(plot):
        rows = [{"label": c, "runs": [[R[(l, s, c)][k] for k in ("p50", "p90", "p99")] for s in seeds if R[(l, s, c)]]}
                for c in configs]
        series = [{"label": c, "values": [x for s in seeds if R[(l, s, c)] for x in R[(l, s, c)]["ttft"]]} for c in configs]
        specs = {
            f"{l}-ttft.svg": {"kind": "percentiles", "rows": rows,
                              "title": f"TTFT p50 / p90 / p99, {l} load (one column per seed: {' '.join(seeds)})"},
            f"{l}-tail.svg": {"kind": "ccdf", "series": series,
                              "title": f"TTFT tail, {l} load (seeds pooled): share of requests with TTFT ≥ x"},
        }
        for name, spec in specs.items():
            tmp = os.path.join(out, "." + name + ".json")
            json.dump(spec, open(tmp, "w"))
            subprocess.run([plot, tmp, os.path.join(plots_dir, name)], check=True)
            os.remove(tmp)

w("Config files: " + "; ".join(
    f"`{c}`: " + (" ".join(l.strip() for l in open(f"bench/tail/{c}.yaml") if not l.startswith("#")).replace("|", "\\|")
                  if os.path.exists(f"bench/tail/{c}.yaml") else label_of(c)) for c in configs) + ".")
w("")

disc = ""
if os.path.exists(md):
    old = open(md).read()
    k = old.find("<!-- discussion -->")
    if k >= 0:
        disc = old[k:]
w(disc.rstrip() if disc else "<!-- discussion -->\n## Discussion\n\n(to be written after looking at the numbers)")
os.makedirs(os.path.dirname(md) or ".", exist_ok=True)
open(md, "w").write("\n".join(L) + "\n")
