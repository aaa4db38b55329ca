//! Engine load signals: what an inference engine says about its own load in its Prometheus
//! `/metrics`, in vLLM's or SGLang's names. The gateway scrapes them when a service asks
//! (`engine_metrics`, [`crate::background::engine_metrics`]) and shows them in
//! `/admin/instances`; the predicted-TTFT model counts the requests an engine has queued that
//! this gateway did not send (several gateways, or clients going direct, share a fleet).
//!
//! | figure | vLLM | SGLang |
//! |---|---|---|
//! | running requests | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | queued requests | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | KV cache in use (0..1) | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//!
//! Series with several label sets (several models or data-parallel ranks) are summed (the
//! KV usage: the highest). Lines the parser does not know are skipped.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use tokengate_plugins::EngineLoad;

/// Parses a Prometheus text exposition. `None` when it holds none of the known series.
pub fn parse(text: &str) -> Option<EngineLoad> {
    let (mut running, mut waiting, mut usage) = (None::<f64>, None::<f64>, None::<f64>);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        // Skip the labels (their values may hold spaces and braces inside quotes).
        let rest = if rest.starts_with('{') {
            match closing_brace(rest) {
                Some(i) => &rest[i + 1..],
                None => continue,
            }
        } else {
            rest
        };
        let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + v);
        match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => add(&mut running),
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => add(&mut waiting),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                usage = Some(usage.map_or(v, |u| u.max(v)));
            }
            _ => {}
        }
    }
    if running.is_none() && waiting.is_none() && usage.is_none() {
        return None;
    }
    let count = |x: Option<f64>| x.unwrap_or(0.0).clamp(0.0, f64::from(u32::MAX)) as u32;
    Some(EngineLoad {
        running: count(running),
        waiting: count(waiting),
        kv_usage: usage.unwrap_or(0.0).clamp(0.0, 1.0),
    })
}

/// The engine's KV cache size in tokens, when its metrics say: SGLang's
/// `sglang:max_total_num_tokens` (summed over data-parallel ranks), vLLM's
/// `vllm:cache_config_info{block_size="16",num_gpu_blocks="…"}` (the product of its labels).
pub fn cache_tokens(text: &str) -> Option<u64> {
    let mut sglang: Option<u64> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("vllm:cache_config_info{") {
            let labels = &rest[..closing_brace(&line["vllm:cache_config_info".len()..])? - 1];
            let n = |k: &str| label(labels, k).and_then(|v| v.parse::<u64>().ok());
            if let (Some(b), Some(g)) = (n("block_size"), n("num_gpu_blocks")) {
                if b > 0 && g > 0 {
                    return Some(b.saturating_mul(g));
                }
            }
        } else if let Some(rest) = line.strip_prefix("sglang:max_total_num_tokens") {
            let rest = match rest.strip_prefix('{') {
                Some(_) => &rest[closing_brace(rest)? + 1..],
                None => rest,
            };
            if let Some(v) = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
            {
                if v.is_finite() && v >= 1.0 {
                    sglang = Some(sglang.unwrap_or(0) + v as u64);
                }
            }
        }
    }
    sglang
}

/// The engine's KV block size in tokens, when its metrics say: vLLM's
/// `vllm:cache_config_info{block_size="…"}`. (SGLang's page size is not on its `/metrics`;
/// its cached-token counts teach it, see [`EngineSignals::block_tokens`].)
pub fn block_tokens(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let line = line.trim();
        let rest = line.strip_prefix("vllm:cache_config_info{")?;
        let labels = &rest[..closing_brace(&line["vllm:cache_config_info".len()..])? - 1];
        label(labels, "block_size")
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|b| *b > 0)
    })
}

/// The value of label `name` in a label set `a="x",b="y"` (no escapes inside the value).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (k, after) = rest.split_once("=\"")?;
        let (v, tail) = after.split_once('"')?;
        if k.trim_start_matches(',').trim() == name {
            return Some(v);
        }
        rest = tail;
    }
}

/// The index of the `}` closing a label set that starts at `s[0] == '{'`.
fn closing_brace(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// The last scrape of one instance, shared with the scraper (atomics: read on every pick).
#[derive(Debug, Default)]
pub struct EngineSignals {
    running: AtomicU32,
    waiting: AtomicU32,
    /// KV usage in parts per million.
    kv_ppm: AtomicU32,
    /// `clock::now_ms()` of the last successful scrape; 0 = never.
    at_ms: AtomicU64,
    /// Consecutive failed scrapes.
    failures: AtomicU32,
    /// The engine's KV cache size in tokens from its metrics ([`cache_tokens`]); 0 = unknown.
    cache_tokens: AtomicU64,
    /// The engine's KV block size in tokens from its metrics ([`block_tokens`]); 0 = unknown.
    reported_block: AtomicU64,
    /// The greatest common divisor of the cached-token counts it reported
    /// ([`tokengate_plugins::calibrate::learn_block`]); 0 = none yet.
    learned_block: AtomicU64,
    /// The engine's prompt tokens per token of the gateway's estimate, a moving average
    /// (`f64` bits; 0 = no report yet).
    tokens_per_estimate: AtomicU64,
}

/// Weight of one report in [`EngineSignals::tokens_per_estimate`].
const TOKENS_PER_ESTIMATE_WEIGHT: f64 = 0.05;

impl EngineSignals {
    pub fn store(&self, l: EngineLoad, now_ms: u64) {
        self.running.store(l.running, Relaxed);
        self.waiting.store(l.waiting, Relaxed);
        self.kv_ppm
            .store((l.kv_usage * 1e6).round() as u32, Relaxed);
        self.at_ms.store(now_ms.max(1), Relaxed);
        self.failures.store(0, Relaxed);
    }

    /// The KV cache size read from a scrape (kept: it does not change while the engine runs).
    pub fn store_cache_tokens(&self, tokens: u64) {
        self.cache_tokens.store(tokens, Relaxed);
    }

    /// The engine's KV cache size in tokens, when a scrape said.
    pub fn cache_tokens(&self) -> Option<u64> {
        Some(self.cache_tokens.load(Relaxed)).filter(|t| *t > 0)
    }

    /// The KV block size read from a scrape.
    pub fn store_block_tokens(&self, tokens: u64) {
        self.reported_block.store(tokens, Relaxed);
    }

    /// Learns the block size from one cached-token count the engine reported.
    pub fn observe_cached(&self, cached: u64) {
        let _ = self.learned_block.fetch_update(Relaxed, Relaxed, |b| {
            Some(tokengate_plugins::calibrate::learn_block(b, cached))
        });
    }

    /// Learns how the engine's tokenizer counts against the gateway's estimate (4 prompt
    /// bytes per token) from one request: `engine` prompt tokens where the gateway estimated
    /// `estimate`.
    pub fn observe_prompt(&self, engine: u64, estimate: u64) {
        if engine == 0 || estimate < 16 {
            return; // too short to say (templates add a few tokens of their own)
        }
        let x = (engine as f64 / estimate as f64).clamp(0.1, 10.0);
        let _ = self
            .tokens_per_estimate
            .fetch_update(Relaxed, Relaxed, |bits| {
                let avg = f64::from_bits(bits);
                let next = if avg > 0.0 {
                    avg + TOKENS_PER_ESTIMATE_WEIGHT * (x - avg)
                } else {
                    x
                };
                Some(next.to_bits())
            });
    }

    /// The engine's prompt tokens per token of the gateway's estimate, once it has reported
    /// one ([`observe_prompt`](Self::observe_prompt)).
    pub fn tokens_per_estimate(&self) -> Option<f64> {
        Some(f64::from_bits(self.tokens_per_estimate.load(Relaxed))).filter(|r| *r > 0.0)
    }

    /// The size of the blocks the engine caches in: from its metrics, else learned from its
    /// cached-token counts, at most
    /// [`MAX_LEARNED_BLOCK`](tokengate_plugins::calibrate::MAX_LEARNED_BLOCK) (the first
    /// reports are multiples of the block: until they differ, the correction is lenient).
    pub fn block_tokens(&self) -> Option<u64> {
        use tokengate_plugins::calibrate::MAX_LEARNED_BLOCK;
        Some(self.reported_block.load(Relaxed))
            .filter(|b| *b > 0)
            .or_else(|| {
                Some(self.learned_block.load(Relaxed))
                    .filter(|b| *b > 0)
                    .map(|b| b.min(MAX_LEARNED_BLOCK))
            })
    }

    pub fn failed(&self) {
        self.failures.fetch_add(1, Relaxed);
    }

    /// The last figures, when scraped within `max_age_ms`.
    pub fn fresh(&self, now_ms: u64, max_age_ms: u64) -> Option<EngineLoad> {
        let at = self.at_ms.load(Relaxed);
        if at == 0 || now_ms.saturating_sub(at) > max_age_ms {
            return None;
        }
        Some(EngineLoad {
            running: self.running.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            kv_usage: f64::from(self.kv_ppm.load(Relaxed)) / 1e6,
        })
    }

    /// For `/admin/instances`: the figures, their age and the failures since the last success.
    pub fn view(&self, now_ms: u64) -> EngineView {
        let at = self.at_ms.load(Relaxed);
        EngineView {
            running: self.running.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            kv_usage: f64::from(self.kv_ppm.load(Relaxed)) / 1e6,
            age_ms: (at > 0).then(|| now_ms.saturating_sub(at)),
            consecutive_failures: self.failures.load(Relaxed),
            cache_tokens: self.cache_tokens(),
            block_tokens: self.block_tokens(),
            tokens_per_estimate: self.tokens_per_estimate(),
        }
    }
}

/// An instance's engine figures as `/admin/instances` shows them (`engine_metrics:`).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct EngineView {
    pub running: u32,
    pub waiting: u32,
    /// KV cache in use, 0–1.
    pub kv_usage: f64,
    /// Since the last successful scrape (null: never scraped).
    pub age_ms: Option<u64>,
    pub consecutive_failures: u32,
    pub cache_tokens: Option<u64>,
    pub block_tokens: Option<u64>,
    pub tokens_per_estimate: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizer_ratio_is_a_moving_average_of_the_reports() {
        let e = EngineSignals::default();
        assert_eq!(e.tokens_per_estimate(), None);
        e.observe_prompt(500, 10); // too short a prompt to say
        assert_eq!(e.tokens_per_estimate(), None);
        e.observe_prompt(2000, 1000);
        assert_eq!(e.tokens_per_estimate(), Some(2.0));
        for _ in 0..200 {
            e.observe_prompt(1150, 1000);
        }
        let r = e.tokens_per_estimate().unwrap();
        assert!((r - 1.15).abs() < 0.01, "{r}");
    }

    #[test]
    fn the_block_size_from_metrics_before_the_learned_one() {
        let e = EngineSignals::default();
        assert_eq!(e.block_tokens(), None);
        e.observe_cached(896);
        // One report of 7 blocks: a multiple of the block, capped.
        assert_eq!(e.block_tokens(), Some(128));
        e.observe_cached(96);
        assert_eq!(e.block_tokens(), Some(32));
        e.store_block_tokens(16);
        assert_eq!(e.block_tokens(), Some(16));
    }

    /// From a vLLM 0.9 server (trimmed).
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.8125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 123456.0
"#;

    /// From an SGLang server (trimmed), two data-parallel ranks.
    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 12.0
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 10.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 4.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 0.61
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 0.74
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 1534.2
"#;

    #[test]
    fn vllm_and_sglang_names() {
        assert_eq!(
            parse(VLLM),
            Some(EngineLoad {
                running: 7,
                waiting: 3,
                kv_usage: 0.8125
            })
        );
        assert_eq!(
            parse(SGLANG),
            Some(EngineLoad {
                running: 22,
                waiting: 5,
                kv_usage: 0.74
            })
        );
    }

    #[test]
    fn the_kv_cache_size_from_either_engine() {
        // vLLM: an info gauge whose labels carry the figures.
        let v = format!(
            "{VLLM}# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_cpu_blocks=\"None\",num_gpu_blocks=\"27153\"}} 1.0\n"
        );
        assert_eq!(cache_tokens(&v), Some(16 * 27153));
        assert_eq!(block_tokens(&v), Some(16));
        assert_eq!(block_tokens(VLLM), None);
        // SGLang: one pool per data-parallel rank.
        let s = format!(
            "{SGLANG}sglang:max_total_num_tokens{{model_name=\"m\",dp_rank=\"0\"}} 500000.0\n\
             sglang:max_total_num_tokens{{model_name=\"m\",dp_rank=\"1\"}} 500000.0\n"
        );
        assert_eq!(cache_tokens(&s), Some(1_000_000));
        assert_eq!(block_tokens(&s), None);
        // Not there, or not usable.
        assert_eq!(cache_tokens(VLLM), None);
        assert_eq!(
            cache_tokens("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n"),
            None
        );
        assert_eq!(cache_tokens("sglang:max_total_num_tokens NaN\n"), None);
    }

    #[test]
    fn older_vllm_names_odd_labels_and_garbage() {
        let t = "vllm:gpu_cache_usage_perc{model_name=\"a \\\"b} c\"} 0.5 1700000000000\n\
                 vllm:num_requests_running 2\n\
                 vllm:num_requests_waiting{x=\"1\"} NaN\n\
                 not a metric line\n\
                 vllm:num_requests_waiting{broken 5\n";
        assert_eq!(
            parse(t),
            Some(EngineLoad {
                running: 2,
                waiting: 0,
                kv_usage: 0.5
            })
        );
        assert_eq!(parse("# nothing\nother_metric 1\n"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn stale_signals_are_not_used() {
        let s = EngineSignals::default();
        assert_eq!(s.fresh(1000, 5000), None);
        s.store(
            EngineLoad {
                running: 1,
                waiting: 2,
                kv_usage: 0.25,
            },
            1000,
        );
        assert_eq!(s.fresh(3000, 5000).unwrap().waiting, 2);
        assert_eq!(s.fresh(7000, 5000), None);
    }
}
