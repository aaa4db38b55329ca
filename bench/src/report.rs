//! The result of a replay: per-request records, the summary computed from them, run
//! metadata, and its markdown rendering.
//!
//! Latency percentiles are nearest-rank over *successful* requests (TTFT, end-to-end, TPOT)
//! or over every gap between content chunks of successful requests (ITL). Throughput divides
//! by the wall time from the first send to the last completion. The cached ratio is the
//! engines' own count: Σ `cached_tokens` / Σ `prompt_tokens` over successful requests.
//! In-flight per instance is the client's view: a request counts for its instance from its
//! send to its end, averaged over each time bucket (so 0.5 = in flight half the bucket).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One request as the client saw it. Times are ms since the start of the run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the workload (trace line after --skip, or the synthetic request counter).
    pub index: usize,
    /// Session key: the trace's conversation root (`trace-<id>`), the synthetic session
    /// (`syn-<seed>-<s>`) or the agentic one (`agt-<seed>-<s>`); sent as the session header
    /// only when session headers are on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Session turn number (0-based; synthetic and agentic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    /// Agentic: the session's tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<usize>,
    /// URL the request went to.
    pub url: String,
    /// When the workload asked for it to be sent.
    pub scheduled_ms: f64,
    /// When it was sent (after waiting for the concurrency cap, if it had to).
    pub sent_ms: f64,
    pub end_ms: f64,
    /// Had to wait for a free slot under --concurrency.
    pub waited_for_slot: bool,
    /// Prompt/output tokens the workload intended (engine-sim counts the chat template too).
    pub intended_input_tokens: usize,
    pub intended_output_tokens: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Error kind: `http_<status>`, `connect`, `transport`, `timeout`, `stream_broken`,
    /// `stream_error` (an error event in the stream), `incomplete` (no `[DONE]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_detail: Option<String>,
    /// `x-tokengate-instance`, else `x-engine-id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
    pub content_chunks: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// The instance label used in the report (`-` when no response named one).
    pub fn instance_label(&self) -> &str {
        self.instance.as_deref().unwrap_or("-")
    }
}

/// Machine the run was made on.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MachineInfo {
    pub nproc: usize,
    pub mem_total_bytes: Option<u64>,
    pub kernel: Option<String>,
    pub cpu_model: Option<String>,
    pub hostname: Option<String>,
}

impl MachineInfo {
    /// Reads /proc (Linux); fields that cannot be read stay empty.
    pub fn detect() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let mem_total_bytes = read("/proc/meminfo").and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
                .map(|kb| kb * 1024)
        });
        let kernel = match (
            read("/proc/sys/kernel/ostype"),
            read("/proc/sys/kernel/osrelease"),
        ) {
            (Some(t), Some(r)) => Some(format!("{} {}", t.trim(), r.trim())),
            (None, Some(r)) => Some(r.trim().to_string()),
            _ => None,
        };
        let cpu_model = read("/proc/cpuinfo").and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        MachineInfo {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_total_bytes,
            kernel,
            cpu_model,
            hostname: read("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()),
        }
    }
}

/// What was run, where, when.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunMeta {
    pub tool: String,
    pub tokengate_version: String,
    pub command_line: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    pub seed: u64,
    pub machine: MachineInfo,
    pub urls: Vec<String>,
    pub url_policy: String,
    pub model: String,
    /// `trace`, `synthetic` or `agentic`.
    pub workload: String,
    /// The workload's parameters (trace file and scaling, or the synthetic / agentic config;
    /// agentic adds `plan`, the planned sessions' summary).
    pub workload_params: serde_json::Value,
    pub concurrency: usize,
    pub limit: Option<usize>,
    pub duration_s: Option<f64>,
    pub session_header: Option<String>,
}

/// Count, mean and nearest-rank percentiles.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Stats {
    /// Sorts `v` in place.
    pub fn of(v: &mut [f64]) -> Stats {
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let pct = |p: f64| v[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Stats {
            count: n,
            mean: v.iter().sum::<f64>() / n as f64,
            p50: pct(50.0),
            p90: pct(90.0),
            p99: pct(99.0),
            max: v[n - 1],
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Requests the workload produced within --limit / --duration (trace: due before the
    /// end; synthetic: turns the sessions started).
    pub scheduled: usize,
    /// Requests actually sent (ok + failed + cancelled).
    pub sent: usize,
    pub ok: usize,
    /// Finished with an error (see `errors`).
    pub failed: usize,
    /// Still running at the end of the drain timeout (aborted, no record).
    pub cancelled: usize,
    /// Requests that had to wait for a free slot under --concurrency.
    pub waited_for_concurrency: usize,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Throughput {
    /// First send to last completion.
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub prompt_tokens_per_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TokenTotals {
    pub prompt: u64,
    pub cached: u64,
    pub completion: u64,
    /// Σ cached / Σ prompt over successful requests (engine-reported).
    pub cached_ratio: f64,
    /// The ceiling with one infinite cache shared by all instances. Trace: fraction of blocks
    /// (and of tokens) of the replayed requests whose hash id appeared earlier in the replay.
    /// Sessions (synthetic, agentic): fraction of the engines' full prompt blocks (and of
    /// prompt tokens) whose prefix was sent earlier in the run ([`crate::ideal`]).
    pub ideal_block_hit_ratio: Option<f64>,
    pub ideal_token_hit_ratio: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct InstanceStats {
    pub instance: String,
    pub requests: usize,
    pub ok: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub cached_ratio: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Time-averaged in-flight requests over the run.
    pub mean_inflight: f64,
    /// Highest bucket average.
    pub peak_inflight: f64,
}

/// In-flight requests per instance over time (client view).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoadSeries {
    pub bucket_ms: f64,
    /// Same order as `inflight`.
    pub instances: Vec<String>,
    /// `inflight[i][b]` = average in-flight requests of instance i during bucket b.
    pub inflight: Vec<Vec<f64>>,
    /// Mean over busy buckets of (busiest instance's in-flight ÷ mean in-flight across
    /// instances); 1.0 = perfectly even.
    pub imbalance: f64,
}

/// Everything a run produced. `requests` holds the per-request records (not in the JSON
/// report; written with --out-requests).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub meta: RunMeta,
    pub counts: Counts,
    pub throughput: Throughput,
    pub ttft_ms: Stats,
    /// Gaps between consecutive content chunks.
    pub itl_ms: Stats,
    /// Per request: (e2e − ttft) / (content chunks − 1).
    pub tpot_ms: Stats,
    pub e2e_ms: Stats,
    /// Send time − scheduled time (concurrency cap and scheduler lateness).
    pub dispatch_lag_ms: Stats,
    pub tokens: TokenTotals,
    /// Failed requests by kind.
    pub errors: BTreeMap<String, usize>,
    /// One example message per error kind.
    pub error_samples: BTreeMap<String, String>,
    pub instances: Vec<InstanceStats>,
    pub load: LoadSeries,
    #[serde(skip)]
    pub requests: Vec<RequestRecord>,
}

/// Upper bound of buckets in the load series (the bucket grows to stay under it).
const MAX_BUCKETS: usize = 20_000;

/// Time-weighted in-flight per instance.
pub fn load_series(records: &[RequestRecord], bucket_ms: f64) -> LoadSeries {
    let mut names: Vec<String> = records
        .iter()
        .map(|r| r.instance_label().to_string())
        .collect();
    names.sort();
    names.dedup();
    let end = records.iter().map(|r| r.end_ms).fold(0.0, f64::max);
    let mut bucket = bucket_ms.max(1.0);
    while end / bucket > MAX_BUCKETS as f64 {
        bucket *= 2.0;
    }
    let nb = ((end / bucket).ceil() as usize).max(1);
    let mut inflight = vec![vec![0.0; nb]; names.len()];
    for r in records {
        let i = names
            .binary_search_by(|n| n.as_str().cmp(r.instance_label()))
            .unwrap();
        let (a, b) = (r.sent_ms, r.end_ms.max(r.sent_ms));
        let first = (a / bucket) as usize;
        let last = ((b / bucket) as usize).min(nb - 1);
        for (k, slot) in inflight[i]
            .iter_mut()
            .enumerate()
            .take(last + 1)
            .skip(first)
        {
            let lo = a.max(k as f64 * bucket);
            let hi = b.min((k + 1) as f64 * bucket);
            if hi > lo {
                *slot += (hi - lo) / bucket;
            }
        }
    }
    let mut ratios = Vec::new();
    // Only instances that served requests take part in the balance measure.
    let real: Vec<usize> = (0..names.len()).filter(|&i| names[i] != "-").collect();
    if real.len() > 1 {
        let (mut sum, mut max) = (vec![0.0f64; nb], vec![0.0f64; nb]);
        for &i in &real {
            for (b, &v) in inflight[i].iter().enumerate() {
                sum[b] += v;
                max[b] = max[b].max(v);
            }
        }
        let n = real.len() as f64;
        ratios.extend(
            sum.iter()
                .zip(&max)
                .filter(|(s, _)| **s > 0.0)
                .map(|(s, m)| m / (s / n)),
        );
    }
    let imbalance = if ratios.is_empty() {
        1.0
    } else {
        ratios.iter().sum::<f64>() / ratios.len() as f64
    };
    LoadSeries {
        bucket_ms: bucket,
        instances: names,
        inflight,
        imbalance,
    }
}

impl Report {
    /// Computes the summary from the records. `itl_ms` holds every inter-chunk gap of
    /// successful requests.
    pub fn build(
        meta: RunMeta,
        mut counts: Counts,
        mut records: Vec<RequestRecord>,
        mut itl_ms: Vec<f64>,
        bucket_ms: f64,
    ) -> Report {
        records.sort_by_key(|r| r.index);
        counts.sent = records.len() + counts.cancelled;
        counts.ok = records.iter().filter(|r| r.ok()).count();
        counts.failed = records.len() - counts.ok;
        let ok = || records.iter().filter(|r| r.ok());
        let mut ttft: Vec<f64> = ok().filter_map(|r| r.ttft_ms).collect();
        let mut e2e: Vec<f64> = ok().filter_map(|r| r.e2e_ms).collect();
        let mut tpot: Vec<f64> = ok()
            .filter(|r| r.content_chunks > 1)
            .filter_map(|r| Some((r.e2e_ms? - r.ttft_ms?) / (r.content_chunks - 1) as f64))
            .collect();
        let mut lag: Vec<f64> = records.iter().map(|r| r.sent_ms - r.scheduled_ms).collect();
        let first = records
            .iter()
            .map(|r| r.sent_ms)
            .fold(f64::INFINITY, f64::min);
        let last = records.iter().map(|r| r.end_ms).fold(0.0, f64::max);
        let wall_s = if records.is_empty() {
            0.0
        } else {
            ((last - first) / 1000.0).max(1e-9)
        };
        let sum = |f: fn(&RequestRecord) -> Option<u64>| ok().filter_map(f).sum::<u64>();
        let prompt = sum(|r| r.prompt_tokens);
        let cached = sum(|r| r.cached_tokens);
        let completion = sum(|r| r.completion_tokens);
        let per_s = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };

        let mut errors = BTreeMap::new();
        let mut error_samples = BTreeMap::new();
        for r in records.iter().filter(|r| !r.ok()) {
            let kind = r.error.clone().unwrap_or_default();
            *errors.entry(kind.clone()).or_insert(0) += 1;
            if let Some(d) = &r.error_detail {
                error_samples.entry(kind).or_insert_with(|| d.clone());
            }
        }

        let load = load_series(&records, bucket_ms);
        let instances = load
            .instances
            .iter()
            .zip(&load.inflight)
            .map(|(name, series)| {
                let mine = || records.iter().filter(|r| r.instance_label() == name);
                let mine_ok = || mine().filter(|r| r.ok());
                let p: u64 = mine_ok().filter_map(|r| r.prompt_tokens).sum();
                let c: u64 = mine_ok().filter_map(|r| r.cached_tokens).sum();
                let mut t: Vec<f64> = mine_ok().filter_map(|r| r.ttft_ms).collect();
                let ts = Stats::of(&mut t);
                InstanceStats {
                    instance: name.clone(),
                    requests: mine().count(),
                    ok: mine_ok().count(),
                    prompt_tokens: p,
                    cached_tokens: c,
                    cached_ratio: ratio(c, p),
                    ttft_p50_ms: ts.p50,
                    ttft_p99_ms: ts.p99,
                    mean_inflight: series.iter().sum::<f64>() / series.len().max(1) as f64,
                    peak_inflight: series.iter().cloned().fold(0.0, f64::max),
                }
            })
            .collect();

        Report {
            meta,
            throughput: Throughput {
                wall_s,
                requests_per_s: per_s(counts.ok as f64),
                output_tokens_per_s: per_s(completion as f64),
                prompt_tokens_per_s: per_s(prompt as f64),
            },
            counts,
            ttft_ms: Stats::of(&mut ttft),
            itl_ms: Stats::of(&mut itl_ms),
            tpot_ms: Stats::of(&mut tpot),
            e2e_ms: Stats::of(&mut e2e),
            dispatch_lag_ms: Stats::of(&mut lag),
            tokens: TokenTotals {
                prompt,
                cached,
                completion,
                cached_ratio: ratio(cached, prompt),
                ideal_block_hit_ratio: None,
                ideal_token_hit_ratio: None,
            },
            errors,
            error_samples,
            instances,
            load,
            requests: records,
        }
    }

    /// Per-request records as JSON lines.
    pub fn requests_jsonl(&self) -> String {
        let mut s = String::new();
        for r in &self.requests {
            s.push_str(&serde_json::to_string(r).unwrap_or_default());
            s.push('\n');
        }
        s
    }

    /// A markdown summary.
    pub fn to_markdown(&self) -> String {
        let m = &self.meta;
        let mut s = String::new();
        let _ = writeln!(s, "## tokengate bench replay — {} workload\n", m.workload);
        let _ = writeln!(s, "- command: `{}`", m.command_line);
        let _ = writeln!(
            s,
            "- started: {} · tokengate {} · seed {}",
            m.started_at, m.tokengate_version, m.seed
        );
        let mi = &m.machine;
        let _ = writeln!(
            s,
            "- machine: {} CPUs ({}), {} GiB RAM, {}",
            mi.nproc,
            mi.cpu_model.as_deref().unwrap_or("?"),
            mi.mem_total_bytes.map_or("?".to_string(), |b| format!(
                "{:.1}",
                b as f64 / (1u64 << 30) as f64
            )),
            mi.kernel.as_deref().unwrap_or("?")
        );
        let _ = writeln!(
            s,
            "- target: {} ({}), model `{}`, concurrency cap {}, session header {}",
            m.urls.join(", "),
            m.url_policy,
            m.model,
            m.concurrency,
            m.session_header.as_deref().unwrap_or("off")
        );
        let _ = writeln!(s, "- workload: `{}`\n", m.workload_params);

        let c = &self.counts;
        let t = &self.throughput;
        let _ = writeln!(s, "| requests | sent | ok | failed | cancelled | waited for cap | wall s | req/s | output tok/s | prompt tok/s |");
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.0} | {:.0} |\n",
            c.scheduled,
            c.sent,
            c.ok,
            c.failed,
            c.cancelled,
            c.waited_for_concurrency,
            t.wall_s,
            t.requests_per_s,
            t.output_tokens_per_s,
            t.prompt_tokens_per_s
        );

        let _ = writeln!(s, "| latency (ms) | n | mean | p50 | p90 | p99 | max |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
        for (name, st) in [
            ("TTFT", &self.ttft_ms),
            ("inter-token", &self.itl_ms),
            ("TPOT", &self.tpot_ms),
            ("end-to-end", &self.e2e_ms),
            ("dispatch lag", &self.dispatch_lag_ms),
        ] {
            let _ = writeln!(
                s,
                "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                st.count, st.mean, st.p50, st.p90, st.p99, st.max
            );
        }

        let k = &self.tokens;
        let _ = writeln!(
            s,
            "\nTokens: prompt {} · cached {} · completion {} · **cached ratio {:.1} %**",
            k.prompt,
            k.cached,
            k.completion,
            k.cached_ratio * 100.0
        );
        if let (Some(b), Some(tk)) = (k.ideal_block_hit_ratio, k.ideal_token_hit_ratio) {
            let _ = writeln!(
                s,
                "(ceiling for these requests with one infinite shared cache: {:.1} % of blocks, {:.1} % of tokens)",
                b * 100.0,
                tk * 100.0
            );
        }

        let _ = writeln!(
            s,
            "\n| instance | requests | ok | cached ratio | TTFT p50 | TTFT p99 | mean in-flight | peak in-flight |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for i in &self.instances {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} % | {:.1} | {:.1} | {:.2} | {:.1} |",
                i.instance,
                i.requests,
                i.ok,
                i.cached_ratio * 100.0,
                i.ttft_p50_ms,
                i.ttft_p99_ms,
                i.mean_inflight,
                i.peak_inflight
            );
        }
        let _ = writeln!(
            s,
            "\nLoad imbalance (mean over {:.0} ms buckets of busiest ÷ mean in-flight): {:.2}",
            self.load.bucket_ms, self.load.imbalance
        );
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\n| error | count | example |\n|---|---:|---|");
            for (kind, n) in &self.errors {
                let ex = self.error_samples.get(kind).map_or("", |x| x.as_str());
                let ex: String = ex.chars().take(120).collect();
                let _ = writeln!(s, "| {kind} | {n} | {} |", ex.replace(['|', '\n'], " "));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).rev().map(|x| x as f64).collect();
        let s = Stats::of(&mut v);
        assert_eq!(
            (s.count, s.p50, s.p90, s.p99, s.max),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert_eq!(Stats::of(&mut []), Stats::default());
        assert_eq!(Stats::of(&mut [7.0]).p99, 7.0);
    }

    fn rec(i: usize, inst: &str, a: f64, b: f64) -> RequestRecord {
        RequestRecord {
            index: i,
            instance: Some(inst.into()),
            sent_ms: a,
            end_ms: b,
            ..Default::default()
        }
    }

    #[test]
    fn inflight_is_time_weighted_per_bucket() {
        let recs = vec![
            rec(0, "a", 0.0, 150.0),
            rec(1, "a", 50.0, 100.0),
            rec(2, "b", 100.0, 200.0),
        ];
        let l = load_series(&recs, 100.0);
        assert_eq!(l.instances, vec!["a", "b"]);
        assert_eq!(l.inflight[0], vec![1.5, 0.5]);
        assert_eq!(l.inflight[1], vec![0.0, 1.0]);
        // bucket 0: a=1.5, b=0 → max/mean = 2; bucket 1: a=.5, b=1 → 1/.75
        assert!((l.imbalance - (2.0 + 1.0 / 0.75) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn build_counts_errors_and_tokens() {
        let mut a = rec(0, "a", 0.0, 100.0);
        a.ttft_ms = Some(10.0);
        a.e2e_ms = Some(100.0);
        a.content_chunks = 10;
        a.prompt_tokens = Some(100);
        a.cached_tokens = Some(40);
        a.completion_tokens = Some(10);
        let mut b = rec(1, "b", 0.0, 50.0);
        b.error = Some("http_503".into());
        b.error_detail = Some("busy".into());
        b.prompt_tokens = Some(1000); // failed requests do not count
        let r = Report::build(
            RunMeta::default(),
            Counts {
                scheduled: 2,
                ..Default::default()
            },
            vec![b, a],
            vec![10.0; 9],
            100.0,
        );
        assert_eq!((r.counts.sent, r.counts.ok, r.counts.failed), (2, 1, 1));
        assert_eq!(r.errors.get("http_503"), Some(&1));
        assert!((r.tokens.cached_ratio - 0.4).abs() < 1e-9);
        assert_eq!(r.tpot_ms.p50, 10.0);
        assert_eq!(r.instances.len(), 2);
        assert_eq!(r.requests[0].index, 0);
        let md = r.to_markdown();
        assert!(md.contains("cached ratio 40.0 %"), "{md}");
        assert!(md.contains("| http_503 | 1 | busy |"), "{md}");
        let json = serde_json::to_string(&r).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(back.counts.ok, 1);
        assert!(back.requests.is_empty());
    }
}
