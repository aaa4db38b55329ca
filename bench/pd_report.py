#!/usr/bin/env python3
"""bench/pd.sh's report: reads the per-run results under OUT and writes MD: one table per
config (a row per seed, then the median), the PD configs against the integrated fleet and smg's
PD router against tokengate's in the same seed, and the smg command-line probe.

Usage: pd_report.py OUT MD "SEEDS" "CONFIGS"; environment: CMD (the command line).
The text after "<!-- discussion -->" in an existing MD is kept.
"""
import json
import os
import statistics
import subprocess
import sys

out, md = sys.argv[1], sys.argv[2]
seeds, configs = sys.argv[3].split(), sys.argv[4].split()
BASE = "tg-integrated"
MARK = "<!-- discussion -->"

LABELS = {
    "tg-integrated": "tokengate, integrated engines",
    "tg-pd-sglang": "tokengate PD, sglang-mooncake",
    "tg-pd-vllm": "tokengate PD, vllm-nixl",
    "smg-pd": "smg PD (sglang, workers via POST /workers)",
    "smg-integrated": "smg cache_aware, integrated engines",
}


def read(path, default=None):
    try:
        with open(path) as f:
            return json.load(f) if path.endswith(".json") else f.read()
    except (OSError, ValueError):
        return default


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def run(seed, config):
    d = os.path.join(out, f"s{seed}", config)
    r = read(os.path.join(d, "report.json"))
    if r is None:
        return {"missing": (read(os.path.join(d, "skipped.txt"), "") or "no result").strip()}
    eng = {k: v for k, v in (read(os.path.join(d, "engines.json"), {}) or {}).items() if v}
    tot = lambda key: sum(e.get(key, 0) for e in eng.values())  # noqa: E731
    c = r["counts"]
    errors = dict(r["errors"])
    if c["cancelled"]:
        errors["cancelled"] = c["cancelled"]
    load = (read(os.path.join(d, "load.txt"), "") or "").split("\n")
    la = [ln.split()[1] for ln in load if ln.startswith(("before:", "after:")) and len(ln.split()) > 1]
    steps = tot("decode_steps")
    return {
        "r": r, "sent": c["sent"], "ok": c["ok"], "failed": c["failed"] + c["cancelled"], "errors": errors,
        "ttft50": r["ttft_ms"]["p50"], "ttft90": r["ttft_ms"]["p90"], "ttft99": r["ttft_ms"]["p99"],
        "tpot50": r["tpot_ms"]["p50"], "tpot99": r["tpot_ms"]["p99"],
        "e2e50": r["e2e_ms"]["p50"], "e2e99": r["e2e_ms"]["p99"],
        "otps": r["throughput"]["output_tokens_per_s"],
        "hits": tot("prefix_cache_hits"), "queries": tot("prefix_cache_queries"),
        "eng_ratio": tot("prefix_cache_hits") / tot("prefix_cache_queries") if tot("prefix_cache_queries") else None,
        "client_ratio": r["tokens"]["cached_ratio"], "ideal": r["tokens"].get("ideal_token_hit_ratio"),
        "mixed": tot("mixed_steps") / steps if steps else None,
        "kv": tot("pd_transfers_received"), "kv_err": tot("pd_transfer_timeouts") + tot("pd_transfer_errors"),
        "lag99": r["dispatch_lag_ms"]["p99"], "load": "→".join(la) or "?",
        "wall": (read(os.path.join(d, "wall_s.txt"), "?") or "?").strip(),
    }


R = {(s, c): run(s, c) for s in seeds for c in configs}
present = [v for v in R.values() if "r" in v]
if not present:
    sys.exit(f"no results under {out}")
meta = present[0]["r"]["meta"]
mach = meta["machine"]


def ms(x):
    return "–" if x is None else f"{x:,.0f}"


def ms1(x):
    return "–" if x is None else f"{x:,.1f}"


def pct(x):
    return "–" if x is None else f"{x * 100:.1f} %"


def ktok(x):
    return "–" if x is None else f"{x / 1000:,.0f} k"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def err_cell(v):
    if not v["failed"]:
        return "0"
    return f"{v['failed']} (" + ", ".join(f"{k} {n}" for k, n in sorted(v["errors"].items())) + ")"


flags = {}
for line in (read(os.path.join(out, "flags.txt"), "") or "").splitlines():
    k, _, v = line.partition(": ")
    flags[k] = v
build = (read(os.path.join(out, "build.txt"), "") or "").splitlines()
commit = (build[0] if build else "") or "?"
dirty = len(build) > 1 and build[1].strip()
wall = (read(os.path.join(out, "wall_s.txt"), "") or "").strip()
smgv = sh("smg --version 2>&1 | head -1") or "?"


def fleet(kind):
    """The engine ids of the first run of an integrated or a PD config, as 'e1, e2, …'."""
    for c in configs:
        if ("pd" in c) != (kind == "pd"):
            continue
        for s in seeds:
            e = read(os.path.join(out, f"s{s}", c, "engines.json"))
            if e:
                ids = list(e)
                if kind == "pd":
                    p = [i for i in ids if i.startswith("p")]
                    d = [i for i in ids if i.startswith("d")]
                    return f"{len(p)} prefill ({', '.join(p)}) + {len(d)} decode ({', '.join(d)})"
                return f"{len(ids)} engines ({', '.join(ids)})"
    return None


rel = lambda t: t.replace(os.getcwd() + "/", "")  # noqa: E731
rustc = sh("rustc --version") or "?"

L = []
w = L.append
w("# Prefill/decode disaggregation: a PD engine-sim fleet vs integrated engines (issue 15)")
w("")
w(f"Command: `{os.environ.get('CMD', '?')}`" + (f" (total wall time {int(wall) // 60} min {int(wall) % 60} s, build excluded)." if wall.isdigit() else "."))
w("")
w(f"Generated by `bench/pd.sh` (first run started {meta['started_at']}). Machine: {mach['nproc']} cores "
  f"({mach.get('cpu_model') or '?'}), {(mach.get('mem_total_bytes') or 0) / 2**30:.1f} GiB RAM, {mach.get('kernel') or '?'}; "
  f"tokengate {meta['tokengate_version']} at commit {commit}{f' (uncommitted: {dirty.split()[-1]})' if dirty else ''} "
  f"(release build, {rustc}); {smgv}. The replay client, the router and the engines share these "
  f"{mach['nproc']} cores, one run at a time; each run has a fresh fleet (cold caches). Runs are interleaved "
  "per seed: every config of seed 1, then of seed 2, …")
w("")
w(f"- Workload, the same for every config of a seed (`tokengate bench replay`): `{rel(flags.get('workload', '?'))}` "
  "plus `--skip (seed − 1) × WINDOW --seed <seed>`: each seed replays another stretch of the Mooncake "
  "conversation trace, full-size prompts (no `--block-tokens` scaling), streamed.")
w(f"- Every engine-sim: `{flags.get('sim', '?')}`; PD engines also `{flags.get('pd sim', '?')}` and "
  "`--role prefill|decode --pd-mode sglang|vllm` (SGLang prefills with a bootstrap port of their own)."
  + (f" Integrated: {fleet('int')}." if fleet("int") else "") + (f" PD: {fleet('pd')}." if fleet("pd") else ""))
w("- Routers: tokengate `scheduler: {mode: layered}` (+ `pd: {mode, decode_policy: least-token}` for PD), "
  "`threads: 2`; smg `--policy cache_aware` (its default; in PD mode it picks the prefill and the decode).")
w("")
w("Columns: **sent / ok / failed** (failed includes requests cancelled at the drain deadline; error kinds in "
  "brackets); TTFT, TPOT (per request, (e2e − TTFT) / (tokens − 1)) and end-to-end latency in ms over "
  "successful requests (nearest rank); **out tok/s** = output tokens per second, first send → last end "
  "(open loop: the trace sets the demand, so this mostly moves with the tail); **engine cached** = Σ "
  "`prefix_cache_hits` over the engines' own `/admin/stats` (tokens) and ÷ Σ `prefix_cache_queries` "
  "(PD: only prefill engines look up prefixes); **client cached / ideal** = Σ `cached_tokens` ÷ Σ "
  "`prompt_tokens` in the usage the client received, and the run's ceiling (one infinite cache shared by "
  "all engines); **mixed steps** = decode steps that carried a prefill chunk ÷ all decode steps (the "
  "interference PD removes); **KV** = KV transfers the decode engines received (errors/timeouts in "
  "brackets); **lag p99** = the client's dispatch lag (if it grows, the 2 cores, not the target, are "
  "the bottleneck); **load** = 1-min load average before → after the run.")
w("")

cols = ("| seed | sent | ok | failed | TTFT p50 | p90 | p99 | TPOT p50 | p99 | e2e p50 | p99 | out tok/s "
        "| engine cached | client cached / ideal | mixed steps | KV | lag p99 | load | wall s |")
sep = "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"
for c in configs:
    w(f"## {c}: {LABELS.get(c, c)}")
    w("")
    router = read(os.path.join(out, f"s{seeds[0]}", c, "router.txt"))
    if router:
        w("Router: " + router.strip().splitlines()[0] + " (details in `router.txt` of each run).")
        w("")
    w(cols)
    w(sep)
    vs = []
    for s in seeds:
        v = R[(s, c)]
        if "r" not in v:
            w(f"| {s} | {v['missing']} |" + " |" * 17)
            continue
        vs.append(v)
        kv = "–" if not v["kv"] else f"{v['kv']}" + (f" ({v['kv_err']})" if v["kv_err"] else "")
        w(f"| {s} | {v['sent']} | {v['ok']} | {err_cell(v)} | {ms(v['ttft50'])} | {ms(v['ttft90'])} | {ms(v['ttft99'])} | "
          f"{ms1(v['tpot50'])} | {ms1(v['tpot99'])} | {ms(v['e2e50'])} | {ms(v['e2e99'])} | {ms(v['otps'])} | "
          f"{ktok(v['hits'])} ({pct(v['eng_ratio'])}) | {pct(v['client_ratio'])} / {pct(v['ideal'])} | {pct(v['mixed'])} | "
          f"{kv} | {ms(v['lag99'])} | {v['load']} | {v['wall']} |")
    if len(vs) > 1:
        m = lambda k: med([v[k] for v in vs])  # noqa: E731
        w(f"| **median** | {ms(m('sent'))} | {ms(m('ok'))} | {ms(m('failed'))} | **{ms(m('ttft50'))}** | **{ms(m('ttft90'))}** | "
          f"**{ms(m('ttft99'))}** | **{ms1(m('tpot50'))}** | **{ms1(m('tpot99'))}** | **{ms(m('e2e50'))}** | **{ms(m('e2e99'))}** | "
          f"{ms(m('otps'))} | {ktok(m('hits'))} ({pct(m('eng_ratio'))}) | {pct(m('client_ratio'))} / {pct(m('ideal'))} | "
          f"{pct(m('mixed'))} | | {ms(m('lag99'))} | | |")
    w("")


def versus(a, b, title):
    pairs = [(s, R[(s, a)], R[(s, b)]) for s in seeds if "r" in R[(s, a)] and "r" in R[(s, b)]]
    if not pairs:
        return
    w(f"### {title}")
    w("")
    w(f"{a} ÷ {b} in the same seed (below 1.00: {a} is faster; output tok/s and engine cached: above 1.00 is more):")
    w("")
    keys = [("ttft50", "TTFT p50"), ("ttft90", "p90"), ("ttft99", "p99"), ("tpot50", "TPOT p50"), ("tpot99", "p99"),
            ("e2e50", "e2e p50"), ("e2e99", "p99"), ("otps", "out tok/s"), ("hits", "engine cached")]
    w("| seed | " + " | ".join(k[1] for k in keys) + " |")
    w("|---|" + "---:|" * len(keys))
    better = {k: 0 for k, _ in keys}
    for s, x, y in pairs:
        cells = []
        for k, _ in keys:
            q = x[k] / y[k] if y[k] else None
            cells.append("–" if q is None else f"{q:.2f}")
            if q is not None and ((q > 1) if k in ("otps", "hits") else (q < 1)):
                better[k] += 1
        w(f"| {s} | " + " | ".join(cells) + " |")
    n = len(pairs)
    w(f"| **{a} better in** | " + " | ".join(f"{better[k]}/{n}" for k, _ in keys) + " |")
    w("")


w("## Side by side")
w("")
for c in configs:
    if c != BASE and BASE in configs and c in ("tg-pd-sglang", "tg-pd-vllm", "smg-pd"):
        versus(c, BASE, f"{c} vs {BASE}")
if "smg-pd" in configs and "tg-pd-sglang" in configs:
    versus("smg-pd", "tg-pd-sglang", "smg-pd vs tg-pd-sglang (the same engines and protocol, another router)")
if "smg-integrated" in configs and BASE in configs:
    versus("smg-integrated", BASE, f"smg-integrated vs {BASE}")

probe = read(os.path.join(out, "smg-cli-probe.txt"))
if probe:
    w("## smg started the documented way")
    w("")
    w("`bench/pd.sh` first starts smg with the PD workers on its command line (`--prefill URL BOOTSTRAP_PORT "
      "--decode URL`, as `smg launch --help` shows) in front of a fresh sglang-mode PD fleet and sends one request. "
      "What it recorded (`smg-cli-probe.txt`):")
    w("")
    w("```text")
    w(probe.rstrip())
    w("```")
    w("")

old = read(md, "") or ""
disc = old.split(MARK, 1)[1] if MARK in old else "\n\n_(discussion to be written)_\n"
w(MARK + disc.rstrip("\n"))
with open(md, "w") as f:
    f.write("\n".join(L) + "\n")
