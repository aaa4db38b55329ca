#!/usr/bin/env python3
"""The scorecard of a bench/matrix.sh run (issue 34's bar).

Usage: bench/matrix_scorecard.py OUT > scorecard.md

OUT is a run's directory (target/bench/matrix/<run>): `<cell>/cell.json` and
`<cell>/s<seed>/<config>/summary.json` (bench/matrix.py summarize). Per cell, the medians over
the seeds of every config's TTFT p50 / p90 / p99 (requests sent after the warm-up; a failed
or cancelled request counts as an infinite TTFT) and of the engine-reported cached ratio
(the engines' own prefix-cache counters over the same window); then, per tokengate config,
its medians ÷ smg cache_aware's for p50, p90, p99 and its cached ratio − smg's in points.
Beside them, per session: the median and p90 over the sessions of each session's mean TTFT
(sessions are closed loops: a router that starves some sessions gets fewer of their slow turns
into the per-request percentiles; the per-session figures count every session once).

Per config, one line: the cells won on all four (p50, p90 and p99 below smg's, cached ratio
not below), the cells more than 10 % behind smg on p99, and issue 34's bar: in every cell
p99 <= smg's, p50 <= 1.1 x smg's and cached >= smg's - 1 point, and p99 at least 20 % below
smg's in half the cells or more; beside it, in how many cells that is possible at all: where the
config's p99 floor (summary.json `p99_floor`: the p99 over the requests of what no router can
avoid, a tenant's first prompt prefilled whole at the fastest engine's rate) is at most 0.8 x
smg's p99. Capacity cells (cap-*) get a table of requests per engine
per time bucket instead.

A config run more than once per seed (`NAME@2`, `NAME@3` in CONFIGS beside `NAME`) counts as
NAME with, per seed, the median of its repetitions: tokengate repeats a seed within a few
milliseconds, smg's p99 can differ 2 × between two runs of the same seed, and one draw of it
decides a cell's ratio.
"""
import glob
import gzip
import json
import math
import os
import statistics
import sys

REF = "smg-cache-aware"
KEYS = ("p50", "p90", "p99")
# Per session: the median and p90 over sessions of each session's mean TTFT (bench/matrix.py)
SESSION_KEYS = ("session_mean_ttft_p50", "session_mean_ttft_p90")


BROKEN = []  # runs in which no request was answered ("cell seed N config")


def load(out):
    cells = {}
    for cj in sorted(glob.glob(os.path.join(out, "*", "cell.json"))):
        cell_dir = os.path.dirname(cj)
        cell = os.path.basename(cell_dir)
        runs = {}
        for sj in glob.glob(os.path.join(cell_dir, "s*", "*", "summary.json")):
            parts = sj.split(os.sep)
            seed, config = parts[-3][1:], parts[-2]
            if not seed.isdigit():
                continue
            try:
                v = json.load(open(sj))
            except (OSError, ValueError):
                continue
            for k in KEYS:  # json has no infinity: summarize writes it as a string
                if isinstance(v.get(k), str):
                    v[k] = math.inf
            if v.get("sent_after_warmup", 0) > 0 and v.get("ok_after_warmup", 0) == 0:
                # Not one request answered: the router never served (a harness or start-up
                # failure, not a routing result). Left out of the medians, listed at the end.
                BROKEN.append("%s seed %s %s" % (cell, seed, config))
                continue
            v["_ttft"] = after_warmup(os.path.dirname(sj), v)
            # NAME@k: the k-th repetition of NAME on this seed
            runs.setdefault(config.split("@")[0], {}).setdefault(int(seed), []).append(v)
        runs = {c: {sd: merge(reps) for sd, reps in seeds.items()} for c, seeds in runs.items()}
        cells[cell] = {"def": json.load(open(cj)), "runs": runs}
    return cells


def after_warmup(d, summary):
    """One run's TTFTs after the warm-up, as bench/matrix.py summarize counts them (a failed or
    cancelled request: infinite), for the pooled view; None without its requests file."""
    path = os.path.join(d, "requests.jsonl.gz")
    if not os.path.exists(path):
        return None
    warmup_ms = float(os.environ.get("WARMUP", 2.5)) * 1000
    with gzip.open(path, "rt") as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    t = []
    for r in reqs:
        if r.get("sent_ms", 0) < warmup_ms:
            continue
        ok = r.get("error") is None and r.get("ttft_ms") is not None
        t.append(r["ttft_ms"] if ok else math.inf)
    return t + [math.inf] * int(summary.get("cancelled") or 0)


def merge(reps):
    """One seed's repetitions of a config: the median of each figure (one run: itself)."""
    if len(reps) == 1:
        return reps[0]
    m = dict(reps[0])
    m["_ttft"] = None if any(r.get("_ttft") is None for r in reps) else [x for r in reps for x in r["_ttft"]]
    for k in KEYS + SESSION_KEYS + ("cached", "p99_floor"):
        m[k] = median([r.get(k) for r in reps])
    m["reps"] = len(reps)
    return m


def median(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    xs = sorted(xs)
    n = len(xs)
    # the middle value; with an even count the mean of the two (inf stays inf)
    if n % 2:
        return xs[n // 2]
    a, b = xs[n // 2 - 1], xs[n // 2]
    return math.inf if math.inf in (a, b) else (a + b) / 2


def medians(seeds):
    m = {k: median([s.get(k) for s in seeds.values()]) for k in KEYS + SESSION_KEYS + ("p99_floor",)}
    c = median([s.get("cached") for s in seeds.values()])
    m["cached"] = None if c is None else 100 * c
    reps = max((s.get("reps", 1) for s in seeds.values()), default=1)
    m["n"] = "%d × %d runs" % (len(seeds), reps) if reps > 1 else len(seeds)
    return m


def pooled(seeds):
    """Every seed's requests in one distribution, each seed weighing the same (a seed run k
    times: each of its requests weighs 1/k): the TTFT percentiles (nearest rank by weight) and
    the engines' cached ratio over all of them (None when a seed's requests file is missing)."""
    if any(s.get("_ttft") is None for s in seeds.values()):
        return None
    t = sorted((x, 1.0 / s.get("reps", 1)) for s in seeds.values() for x in s["_ttft"])
    if not t:
        return None
    total = sum(w for _, w in t)
    m = {}
    for k, q in zip(KEYS, (0.5, 0.9, 0.99)):
        acc = 0.0
        for x, w in t:
            acc += w
            if acc >= q * total - 1e-9:
                m[k] = x
                break
    tok = [(s.get("engine_prompt_tokens") or 0, s.get("cached")) for s in seeds.values()]
    den = sum(n for n, c in tok if c is not None)
    m["cached"] = 100 * sum(n * c for n, c in tok if c is not None) / den if den else None
    m["n"] = round(total)
    return m


def ms(v):
    if v is None:
        return "-"
    return "∞" if v == math.inf else "{:,.0f}".format(v)


def ratio(a, b):
    if a is None or b is None:
        return None
    if a == math.inf and b == math.inf:
        return None
    if b == math.inf:
        return 0.0
    if a == math.inf:
        return math.inf
    return a / b if b > 0 else None


def fr(r):
    if r is None:
        return "-"
    if r == 0.0:  # ratio(): smg's figure is ∞ (a failed or cancelled request), this one's not
        return "0 (smg ∞)"
    return "∞" if r == math.inf else "%.2f" % r


def main(out):
    cells = load(out)
    if not cells:
        sys.exit("no cells with results under %s" % out)
    cmd = open(os.path.join(out, "command.txt")).read().strip() if os.path.exists(os.path.join(out, "command.txt")) else ""
    build = open(os.path.join(out, "build.txt")).read().split() if os.path.exists(os.path.join(out, "build.txt")) else []
    wall = open(os.path.join(out, "wall_s.txt")).read().strip() if os.path.exists(os.path.join(out, "wall_s.txt")) else "?"
    print("# Workload matrix scorecard: %s" % os.path.basename(os.path.normpath(out)))
    print()
    for line in cmd.splitlines() or [""]:  # one line per invocation that wrote into this run
        print("- command: `%s`" % line)
    print("- build: %s%s; wall time %s s" % (build[0] if build else "?", " (with uncommitted changes)" if len(build) > 1 else "", wall))
    print("- TTFT: ms (real time; the engines run SIM_TIME_SCALE times faster than their simulated time), medians over the seeds of each seed's percentile over the requests sent after the warm-up; a failed or cancelled request counts as ∞. Cached: the engines' own prefix-cache hits ÷ prompt tokens over the same window, %.")
    print()
    work = {c: v for c, v in cells.items() if not c.startswith("cap-")}
    cap = {c: v for c, v in cells.items() if c.startswith("cap-")}
    configs = sorted({cfg for v in work.values() for cfg in v["runs"]}, key=lambda c: (c.startswith("smg"), c))

    if work:
        print("## Cells")
        print()
        print("| cell | tenants | system | think | header share | one-shot | cache (share of hot set, tokens/engine) | load | engines | prefill | sessions/s | prefill tok/s per engine (sim) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c, v in work.items():
            d = v["def"]
            a = d["axes"]
            print("| %s | %s | %s | %s | %s | %s | %s (%.2f, %s) | %s | %s | %s | %.2f | %.0f |" % (
                c, a["tenants"], a["system"], a["think"], a["header"], a["one-shot"], a["cache"], d["cache_share"],
                "{:,}".format(d["cache_tokens"]), a["load"], a["engines"], a["prefill"], d["session_rate"], d["prefill_tps"]))
        print()
        print("## Every config, medians over the seeds")
        print()
        print("| cell | config | seeds | TTFT p50 | p90 | p99 | cached % | per session p50 | p90 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c, v in work.items():
            for cfg in configs:
                if cfg not in v["runs"]:
                    continue
                m = medians(v["runs"][cfg])
                print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                    c, cfg, m["n"], ms(m["p50"]), ms(m["p90"]), ms(m["p99"]), "-" if m["cached"] is None else "%.1f" % m["cached"],
                    ms(m["session_mean_ttft_p50"]), ms(m["session_mean_ttft_p90"])))
        print()
        lines = []
        for cfg in configs:
            if cfg == REF:
                continue
            print("## %s ÷ %s" % (cfg, REF))
            print()
            print("| cell | p50 ÷ | p90 ÷ | p99 ÷ | cached − (points) | all four | bar | p99 floor ÷ smg's p99 |")
            print("|---|---|---|---|---|---|---|---|")
            won = worse = ahead = possible = n = 0
            fails = []
            for c, v in work.items():
                if cfg not in v["runs"] or REF not in v["runs"]:
                    continue
                a, b = medians(v["runs"][cfg]), medians(v["runs"][REF])
                r = {k: ratio(a[k], b[k]) for k in KEYS}
                dc = None if a["cached"] is None or b["cached"] is None else a["cached"] - b["cached"]
                n += 1
                all4 = all(r[k] is not None and r[k] < 1 for k in KEYS) and dc is not None and dc >= 0
                bar = (r["p99"] is not None and r["p99"] <= 1 and r["p50"] is not None and r["p50"] <= 1.1
                       and dc is not None and dc >= -1)
                won += all4
                worse += r["p99"] is not None and r["p99"] > 1.1
                ahead += r["p99"] is not None and r["p99"] <= 0.8
                # the lowest p99 ratio any router could reach in this cell
                floor = ratio(a.get("p99_floor"), b["p99"])
                possible += floor is None or floor <= 0.8
                if not bar:
                    fails.append(c)
                print("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
                    c, fr(r["p50"]), fr(r["p90"]), fr(r["p99"]), "-" if dc is None else "%+.1f" % dc,
                    "yes" if all4 else "", "ok" if bar else "**no**", fr(floor)))
            print()
            meets = n > 0 and not fails and ahead * 2 >= n
            lines.append("| %s | %d of %d | %d | %d of %d (possible in %d) | %s |" % (
                cfg, won, n, worse, ahead, n, possible,
                ("**yes**" if meets else "no") + ("" if not fails else " (fails in: %s)" % ", ".join(fails))
                + ("" if ahead * 2 >= n else "; ≥ 20 % ahead on p99 in fewer than half")))
        print("## Per config")
        print()
        print("| config | cells won on all four | cells > 10 % behind smg on p99 | cells ≥ 20 % ahead on p99 | issue 34's bar |")
        print("|---|---|---|---|---|")
        for line in lines:
            print(line)
        print()
        pooled_view(work, configs)

    if cap:
        print("## Capacity cells")
        print()
        print("The engine that joined (cap-add) or came back (cap-crash): its requests ÷ the other engines' mean, per time bucket from the first bucket that starts after the event (by send time). 1.0 = its share.")
        print()
        print("| cell | config | seed | event | its share per bucket after it |")
        print("|---|---|---|---|---|")
        for c, v in cap.items():
            for cfg in sorted(v["runs"]):
                for seed, s in sorted(v["runs"][cfg].items()):
                    d = os.path.join(out, c, "s%d" % seed, cfg)
                    try:
                        ev = json.load(open(os.path.join(d, "event.json")))
                    except (OSError, ValueError):
                        print("| %s | %s | %d | no event recorded | |" % (c, cfg, seed))
                        continue
                    pe = s.get("per_engine_per_bucket") or {}
                    b = s.get("bucket_s", 4)
                    first = math.ceil(ev["from_s"] / b)
                    mine = pe.get(ev["engine"], [])
                    others = [xs for e, xs in pe.items() if e not in (ev["engine"], "-")]
                    shares = []
                    for i in range(first, max((len(x) for x in pe.values()), default=0)):
                        m = statistics.mean([xs[i] if i < len(xs) else 0 for xs in others]) if others else 0
                        n = mine[i] if i < len(mine) else 0
                        shares.append("%g-%g s: %s" % (i * b, (i + 1) * b, "%.2f" % (n / m) if m else "-"))
                    print("| %s | %s | %d | %s from %g s | %s |" % (c, cfg, seed, ev["engine"], ev["from_s"], ", ".join(shares)))
        print()
        print("### Requests per engine per time bucket (by send time)")
        print()
        for c, v in cap.items():
            for cfg in sorted(v["runs"]):
                for seed, s in sorted(v["runs"][cfg].items()):
                    ev = os.path.join(out, c, "s%d" % seed, cfg, "event.txt")
                    event = open(ev).read().strip() if os.path.exists(ev) else "no event recorded"
                    pe = s.get("per_engine_per_bucket") or {}
                    nb = max((len(x) for x in pe.values()), default=0)
                    b = s.get("bucket_s", 4)
                    print("**%s, %s, seed %d** (%s; peak in-flight per engine: %s)" % (
                        c, cfg, seed, event, ", ".join("%s %s" % (k, ms(x)) for k, x in sorted((s.get("peak_inflight") or {}).items()))))
                    print()
                    # the largest prefill queue each engine had in each bucket (polled every second)
                    qmax = {}
                    try:
                        for line in open(os.path.join(out, c, "s%d" % seed, cfg, "queues.jsonl")):
                            try:
                                row = json.loads(line)
                            except ValueError:
                                continue
                            i = int(row.get("t", 0) // b)
                            for e, q in row.items():
                                if e != "t":
                                    cur = qmax.setdefault(e, {}).get(i)
                                    qmax[e][i] = q if cur is None else (cur if q is None else max(cur, q))
                    except OSError:
                        pass
                    print("requests sent (peak prefill queue: waiting + prefilling, polled every second; - = down)")
                    print()
                    print("| engine | " + " | ".join("%g-%g s" % (i * b, (i + 1) * b) for i in range(nb)) + " |")
                    print("|---|" + "---|" * nb)
                    for e, xs in sorted(pe.items()):
                        q = qmax.get(e, {})
                        cells = []
                        for i, x in enumerate(xs):
                            if i in q:
                                cells.append("%d (%s)" % (x, "-" if q[i] is None else q[i]))
                            else:
                                cells.append(str(x))
                        print("| %s | " % e + " | ".join(cells) + " |")
                    print()

    if BROKEN:
        print("## Runs left out")
        print()
        print("Not one request answered (the router never served: a start-up or harness failure, not a routing result); rerun them into the same run (`RUN=… CELLS=… SEEDS=… CONFIGS=… bench/matrix.sh`):")
        print()
        for b in sorted(BROKEN):
            print("- " + b)
        print()


def pooled_view(work, configs):
    """A second view, not the bar: every seed's requests pooled into one distribution per cell
    and config. The bar's median over seeds of each seed's p99 is, in a cell of 40-120
    requests a seed, the median of a few seeds' one or two slowest requests; pooled over the
    seeds, p99 is the 1 % slowest of several hundred."""
    rows = []
    for cfg in configs:
        if cfg == REF:
            continue
        passed = ahead = n = 0
        for c, v in work.items():
            if cfg not in v["runs"] or REF not in v["runs"]:
                continue
            a, b = pooled(v["runs"][cfg]), pooled(v["runs"][REF])
            if a is None or b is None:
                continue
            r = {k: ratio(a[k], b[k]) for k in KEYS}
            dc = None if a["cached"] is None or b["cached"] is None else a["cached"] - b["cached"]
            ok = (r["p99"] is not None and r["p99"] <= 1 and r["p50"] is not None and r["p50"] <= 1.1
                  and dc is not None and dc >= -1)
            n += 1
            passed += ok
            ahead += r["p99"] is not None and r["p99"] <= 0.8
            rows.append("| %s | %s | %d / %d | %s | %s | %s | %s | %s |" % (
                c, cfg, a["n"], b["n"], fr(r["p50"]), fr(r["p90"]), fr(r["p99"]),
                "-" if dc is None else "%+.1f" % dc, "ok" if ok else "**no**"))
        if n:
            rows.append("| **%s** | | | | | | | %d of %d ok; ≥ 20 %% ahead on p99 in %d |" % (cfg, passed, n, ahead))
    if not rows:
        return
    print("## Pooled over the seeds (a second view, not the bar)")
    print()
    print("Each config's requests after the warm-up of every seed in one distribution (÷ %s's; cached: all the engines' hits ÷ prompt tokens). The bar above takes each seed's percentile and then the median over the seeds; in the cells with few requests a seed's p99 is its slowest request or two, and one seed's trajectory moves a median. `ok`: the bar's per-cell test on these figures." % REF)
    print()
    print("| cell | config | requests (it / smg, a seed run k times counted once) | p50 ÷ | p90 ÷ | p99 ÷ | cached − (points) | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    print()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
