#!/usr/bin/env python3
"""Every same-run comparison with smg cache_aware in one table (issue 12's bar).

Usage: bench/tail_scorecard.py [--seeds] [--load L] [DIR ...] > scorecard.md

Without DIR it reads every run under target/bench/ (the directories `target/bench/tail*/`
that hold a `command.txt`, oldest first): where `bench/tail.sh` writes its runs by default
(OUT=target/bench/tail; give each run its own OUT, e.g. OUT=target/bench/tail-1536-a, to keep
several). Each DIR is the OUT directory of one `bench/tail.sh` run (`<load>/s<seed>/<config>/report.json`,
`build.txt`, `command.txt`). For every tokengate config that ran next to `smg-cache-aware`, per
load: in how many seeds it beat smg on TTFT p50, p90, p99 (lower) and on the engine-reported
cached ratio (higher), in which seeds on all four at once, and whether that is at least three
seeds (the issue's bar: "beats smg cache_aware in the same run on p50, p90, p99 and the cached
ratio, across at least 3 seeds"); then the medians over the seeds of both. Exact figures from
the reports (the tables of `tail.md` round them). `--seeds` adds a second table with every
config's figures per seed (p50 / p90 / p99 ms, cached %), smg's included; `--load high` keeps
one load (the bar is the high load's).

A run directory needs only `command.txt`, `build.txt` and the `report.json` files, so a
scratch run can be kept for this table without its other files.
"""
import glob
import json
import os
import re
import statistics
import sys

REF = "smg-cache-aware"
KEYS = ("p50", "p90", "p99", "cached")


def report(path):
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        return None
    t = r.get("ttft_ms") or {}
    k = r.get("tokens") or {}
    if t.get("p50") is None or k.get("cached_ratio") is None:
        return None
    return {"p50": t["p50"], "p90": t["p90"], "p99": t["p99"], "cached": 100 * k["cached_ratio"]}


def beats(a, b, key):
    return a[key] > b[key] if key == "cached" else a[key] < b[key]


def first_line(path):
    try:
        return open(path).readline().strip()
    except OSError:
        return ""


ONLY_LOAD = None


def load_runs(d):
    runs = {}
    for p in glob.glob(os.path.join(d, "*", "s*", "*", "report.json")):
        parts = p.split(os.sep)
        load, seed, config = parts[-4], parts[-3][1:], parts[-2]
        v = report(p)
        if v and seed.isdigit() and ONLY_LOAD in (None, load):
            runs[(load, int(seed), config)] = v
    return runs


def per_seed(dirs):
    all_runs = [(d, load_runs(d)) for d in dirs]
    columns = sorted({k[1] for _, runs in all_runs for k in runs})
    print()
    print("| run | load | config | " + " | ".join(f"seed {s}" for s in columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for d, runs in all_runs:
        for load in sorted({k[0] for k in runs}):
            for c in sorted({k[2] for k in runs if k[0] == load}, key=lambda c: (c == REF, c)):
                cells = []
                for s in columns:
                    v = runs.get((load, s, c))
                    cells.append("%.0f / %.0f / %.0f, %.1f" % tuple(v[k] for k in KEYS) if v else "")
                print(f"| {os.path.basename(os.path.normpath(d))} | {load} | {c} | " + " | ".join(cells) + " |")


def main(dirs):
    print("| run | build | KV blocks | load | config | seeds | wins p50 · p90 · p99 · cached | all four in | bar | "
          "medians p50 / p90 / p99 ms, cached % | smg's medians |")
    print("|---|---|---:|---|---|---:|---|---|---|---|---|")
    for d in dirs:
        cmd = first_line(os.path.join(d, "command.txt"))
        blocks = (re.search(r"KV_BLOCKS=(\d+)", cmd) or [None, "?"])[1]
        build = first_line(os.path.join(d, "build.txt")) or "?"
        runs = load_runs(d)
        for load in sorted({k[0] for k in runs}):
            configs = sorted({k[2] for k in runs if k[0] == load and k[2] != REF})
            for c in configs:
                seeds = sorted(s for (l, s, cc) in runs if l == load and cc == c and (l, s, REF) in runs)
                if not seeds:
                    continue
                pairs = [(runs[(load, s, c)], runs[(load, s, REF)]) for s in seeds]
                wins = [sum(beats(a, b, k) for a, b in pairs) for k in KEYS]
                every = [s for s, (a, b) in zip(seeds, pairs) if all(beats(a, b, k) for k in KEYS)]
                med = lambda i, key: statistics.median(p[i][key] for p in pairs)  # noqa: E731
                fmt = lambda i: "%.0f / %.0f / %.0f, %.1f" % tuple(med(i, k) for k in KEYS)  # noqa: E731
                print(f"| {os.path.basename(os.path.normpath(d))} | {build} | {blocks} | {load} | {c} | {len(seeds)} | "
                      f"{' · '.join(str(w) for w in wins)} | {', '.join(map(str, every)) or '–'} | "
                      f"{'met' if len(every) >= 3 else 'not met'} | {fmt(0)} | {fmt(1)} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    seeds = "--seeds" in args
    args = [a for a in args if a != "--seeds"]
    if "--load" in args:
        i = args.index("--load")
        if i + 1 >= len(args):
            sys.exit("--load needs a load name (moderate, high)")
        ONLY_LOAD = args[i + 1]
        del args[i:i + 2]
    if not args:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "bench")
        found = [d for d in glob.glob(os.path.join(root, "tail*")) if os.path.isfile(os.path.join(d, "command.txt"))]
        args = [os.path.relpath(d) for d in sorted(found, key=os.path.getmtime)]
        if not args:
            sys.exit(__doc__ + "\nno run under target/bench/tail*/ (run bench/tail.sh first)")
    main(args)
    if seeds:
        per_seed(args)
