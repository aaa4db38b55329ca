//! `prefix_index:` (which instance holds which prompt prefix) and `cost_model:` (the
//! predicted-TTFT model's priors).

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Settings of the prefix index (shared by layered and policy schedulers).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixIndexSettings {
    /// Tokens per block; match the engines' KV block size (vLLM default 16).
    #[serde(default = "d_block_tokens")]
    pub block_size: usize,
    /// Index entries unused this long are swept.
    #[serde(default = "d_index_ttl", with = "humantime_serde")]
    pub ttl: Duration,
    /// How often expired sessions and index entries are swept and memory is checked.
    #[serde(default = "d_maint", with = "humantime_serde")]
    pub maintenance_interval: Duration,
    /// Evict index entries when the process uses more than container memory × this
    /// (0 → 0.70).
    #[serde(default)]
    pub memory_threshold_ratio: f64,
    /// …or more than container memory − this many GiB (0 → 1.5), whichever comes first.
    #[serde(default)]
    pub reserved_memory_gib: f64,
    /// Container memory in bytes, overriding what cgroups report (for hosts where the
    /// limit is not visible, and for tests).
    #[serde(
        default,
        deserialize_with = "crate::config_source::opt_bytes",
        skip_serializing_if = "Option::is_none"
    )]
    pub memory_limit_bytes: Option<u64>,
}

impl Default for PrefixIndexSettings {
    fn default() -> Self {
        PrefixIndexSettings {
            block_size: d_block_tokens(),
            ttl: d_index_ttl(),
            maintenance_interval: d_maint(),
            memory_threshold_ratio: 0.0,
            reserved_memory_gib: 0.0,
            memory_limit_bytes: None,
        }
    }
}

/// Settings of the predicted-TTFT model: what it assumes before it has learned an instance.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CostModelSettings {
    /// Prefill rate assumed before any is learned, uncached prompt tokens per second (an
    /// instance with too few samples of its own uses the mean of those that have one).
    #[serde(default = "d_prior_tps")]
    pub prior_prefill_tokens_per_second: f64,
    /// Decode step assumed before any is learned.
    #[serde(default = "d_prior_step", with = "humantime_serde")]
    pub prior_decode_step: Duration,
    /// Weight of each new observation in the learned averages (0..1].
    #[serde(default = "d_learning_rate")]
    pub learning_rate: f64,
    /// Extra cost of a request's uncached tokens, as a fraction of their prefill time
    /// (computing a prefix where it is not cached pushes other prefixes out of that cache).
    #[serde(default)]
    pub miss_penalty: f64,
}

impl Default for CostModelSettings {
    fn default() -> Self {
        CostModelSettings {
            prior_prefill_tokens_per_second: d_prior_tps(),
            prior_decode_step: d_prior_step(),
            learning_rate: d_learning_rate(),
            miss_penalty: 0.0,
        }
    }
}

fn d_prior_tps() -> f64 {
    8000.0
}
fn d_prior_step() -> Duration {
    Duration::from_millis(20)
}
fn d_learning_rate() -> f64 {
    0.2
}

fn d_block_tokens() -> usize {
    16
}
fn d_index_ttl() -> Duration {
    Duration::from_secs(259_200)
}
fn d_maint() -> Duration {
    Duration::from_secs(60)
}

impl PrefixIndexSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let pi = self;
        if pi.block_size == 0 {
            errs.push("prefix_index.block_size: must be at least 1".into());
        }
        if !(0.0..1.0).contains(&pi.memory_threshold_ratio) {
            errs.push(
                "prefix_index.memory_threshold_ratio: must be in [0, 1) (0 = default 0.70)".into(),
            );
        }
        if pi.reserved_memory_gib < 0.0 {
            errs.push("prefix_index.reserved_memory_gib: must be >= 0 (0 = default 1.5)".into());
        }
        if pi.maintenance_interval.is_zero() {
            errs.push("prefix_index.maintenance_interval: must be greater than 0".into());
        }
    }
}

impl CostModelSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let cm = self;
        if !(cm.prior_prefill_tokens_per_second.is_finite()
            && cm.prior_prefill_tokens_per_second > 0.0)
        {
            errs.push(
                "cost_model.prior_prefill_tokens_per_second: must be a positive number".into(),
            );
        }
        if !(cm.learning_rate > 0.0 && cm.learning_rate <= 1.0) {
            errs.push("cost_model.learning_rate: must be in (0, 1]".into());
        }
        if !(cm.miss_penalty.is_finite() && cm.miss_penalty >= 0.0) {
            errs.push("cost_model.miss_penalty: must be >= 0".into());
        }
    }
}
