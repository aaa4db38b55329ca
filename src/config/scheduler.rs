//! `services[].scheduler:`: layered mode (session affinity → prefix cache → least cached →
//! load balancing) or policy mode (weighted plugins, see [`super::policy`]).

use super::policy::{d_max_entries, d_session_ttl, validate_policy};
use super::policy::{PluginSettings, PolicySettings};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokengate_plugins::AffinityMode;

/// Default room above the best predicted TTFT for keeping a prefix (or a session) at home.
pub const DEFAULT_TTFT_TOLERANCE: f64 = 0.5;
/// Default absolute room, added to [`DEFAULT_TTFT_TOLERANCE`].
pub const DEFAULT_TTFT_SLACK: Duration = Duration::from_millis(50);
/// Soft session affinity's default room (it leaves the bound instance when its predicted TTFT
/// exceeds best × (1 + this) + [`DEFAULT_AFFINITY_TTFT_SLACK`]): tighter than the other layers',
/// because a burst of turns from sessions bound to one engine is how its queue builds up
/// (`bench/results/tail-explore.md`, third section: seed 4's p99 1,315 → 694 ms together with
/// the prefix layer's waiting cap of 2, the other seeds level or better).
pub const DEFAULT_AFFINITY_TTFT_TOLERANCE: f64 = 0.25;
/// See [`DEFAULT_AFFINITY_TTFT_TOLERANCE`].
pub const DEFAULT_AFFINITY_TTFT_SLACK: Duration = Duration::from_millis(25);
/// Default `min_hit_ratio` of the prefix layer when it compares predicted TTFTs.
pub const DEFAULT_COST_MIN_HIT: f64 = 0.1;
/// The default prefix layer (no `ttft_*`, `load_tolerance` or `waiting_threshold` given)
/// compares costs ([`tokengate_plugins::Adaptive`]): an instance holding the prefix is
/// preferred while its predicted TTFT ≤ the cheapest instance holding less's predicted TTFT +
/// this × the copy's placement (the tokens the copy would write, and so evict, there, at its
/// rate). Until issue 34 the default was a fixed "at most 2 waiting" (16 → 4 → 2 each took a
/// hot-spot seed's p99 down on `bench/tail.sh`), which gave a hot tenant's prefix away
/// whenever one engine could not serve the whole tenant (`docs/matrix-runs.md`, run 1).
pub const DEFAULT_PREFIX_PLACEMENT: f64 = 1.0;
/// The default prefix layer's safety rails: never preferred with in-flight load > average ×
/// (1 + this) (cannot bind with 4 instances or fewer) ...
pub const DEFAULT_PREFIX_LOAD_TOLERANCE: f64 = 3.0;
/// ... or more than this many requests waiting for their first token.
pub const DEFAULT_PREFIX_WAITING_CAP: u64 = 16;
/// The fixed-limit rule's waiting threshold when only `load_tolerance` is given (the
/// pre-issue-34 default).
pub const DEFAULT_PREFIX_WAITING_THRESHOLD: u64 = 2;
/// The default prefix layer's hit: at least this share of the prompt cached there.
pub const DEFAULT_PREFIX_MIN_HIT: f64 = 0.1;

/// How instances of one service are chosen. Absent: layered with its defaults
/// ([`SchedulerConfig::default_layered`]), unless the service sets `load_balancing` (then
/// that alone) or has a single instance.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SchedulerConfig {
    /// Session affinity → prefix cache → load balancing; the first layer that matches routes.
    Layered {
        /// Layer 1; on by default (soft, escape by predicted TTFT; `enabled: false` turns it
        /// off). It binds only requests that carry a session header.
        #[serde(default = "d_affinity")]
        affinity: Option<AffinitySettings>,
        /// Layer 2; on by default (`enabled: false` turns it off).
        #[serde(default)]
        prefix: PrefixSettings,
        /// Layer 3: requests no earlier layer placed go to the instance holding the fewest
        /// cached blocks among those with a near-best predicted TTFT.
        #[serde(default)]
        least_cached: LeastCachedSettings,
    },
    /// Weighted plugin scoring: Σ weight × normalised score, highest wins.
    Policy(PolicySettings),
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AffinitySettings {
    /// `false` turns the layer off (it is on by default in layered mode).
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// `soft` (escape an overloaded instance) or `strict` (always the bound instance).
    #[serde(default)]
    pub mode: AffinityMode,
    /// Request headers carrying the session key, first present wins.
    #[serde(default = "d_session_headers")]
    pub headers: Vec<String>,
    /// Soft mode leaves the bound instance when its load > average × this (the fixed-ratio
    /// rule). Absent, with `ttft_tolerance` or `ttft_slack` set: when its predicted TTFT is
    /// above the best × (1 + `ttft_tolerance`) + `ttft_slack`. With none of the three: when
    /// waiting for it costs more than moving (the stay-or-move comparison,
    /// [`tokengate_plugins::Adaptive`], against every other instance).
    #[serde(default)]
    pub soft_max_load_ratio: Option<f64>,
    /// See `soft_max_load_ratio` (default 0.25 when only `ttft_slack` is set).
    #[serde(default)]
    pub ttft_tolerance: Option<f64>,
    /// See `soft_max_load_ratio` (default 25ms when only `ttft_tolerance` is set).
    #[serde(default, with = "humantime_serde")]
    pub ttft_slack: Option<Duration>,
    /// Binding lifetime, refreshed on use.
    #[serde(default = "d_session_ttl", with = "humantime_serde")]
    pub ttl: Duration,
    /// Most bindings kept; the least recently used are evicted.
    #[serde(default = "d_max_entries")]
    pub max_entries: usize,
}

fn d_affinity() -> Option<AffinitySettings> {
    Some(AffinitySettings::default())
}

impl Default for AffinitySettings {
    fn default() -> Self {
        AffinitySettings {
            enabled: true,
            mode: AffinityMode::default(),
            headers: d_session_headers(),
            soft_max_load_ratio: None,
            ttft_tolerance: None,
            ttft_slack: None,
            ttl: d_session_ttl(),
            max_entries: d_max_entries(),
        }
    }
}

/// The prefix layer. By default an instance holding a prefix is preferred while waiting
/// there costs less than recomputing the prompt elsewhere plus the copy's placement
/// ([`DEFAULT_PREFIX_PLACEMENT`]); with `ttft_tolerance` / `ttft_slack` set, while its
/// predicted TTFT stays within them of the best candidate's; with `load_tolerance` or
/// `waiting_threshold` set, the seed's fixed limits.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixSettings {
    /// `false` turns the layer off.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Below this share of the prompt found on an instance, it is a miss (default 0.1, or
    /// 0.5 with the fixed limits).
    #[serde(default)]
    pub min_hit_ratio: Option<f64>,
    /// Fixed limit: not preferred when its load > average × (1 + this) (default 0.3).
    #[serde(default)]
    pub load_tolerance: Option<f64>,
    /// Fixed limit: not preferred when more requests than this wait for their first token
    /// (default 2 once a fixed limit is set).
    #[serde(default)]
    pub waiting_threshold: Option<u64>,
    /// Preferred while its predicted TTFT ≤ best × (1 + this) + `ttft_slack` (default 0.5).
    #[serde(default)]
    pub ttft_tolerance: Option<f64>,
    /// See `ttft_tolerance` (default 50ms).
    #[serde(default, with = "humantime_serde")]
    pub ttft_slack: Option<Duration>,
}

impl SchedulerConfig {
    /// What a service with more than one instance and neither `scheduler` nor
    /// `load_balancing` gets: `{mode: layered}` with every default.
    pub fn default_layered() -> Self {
        SchedulerConfig::Layered {
            affinity: d_affinity(),
            prefix: PrefixSettings::default(),
            least_cached: LeastCachedSettings::default(),
        }
    }
}

impl Default for PrefixSettings {
    fn default() -> Self {
        PrefixSettings {
            enabled: true,
            min_hit_ratio: None,
            load_tolerance: None,
            waiting_threshold: None,
            ttft_tolerance: None,
            ttft_slack: None,
        }
    }
}

/// The least-cached layer (`scheduler.least_cached`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LeastCachedSettings {
    /// `false` turns the layer off (requests no earlier layer placed go to load balancing).
    #[serde(default = "d_least_cached")]
    pub enabled: bool,
    /// Eligible while its predicted TTFT ≤ best × (1 + this) + `ttft_slack` (default 0.5).
    #[serde(default)]
    pub ttft_tolerance: Option<f64>,
    /// See `ttft_tolerance` (default 50ms).
    #[serde(default, with = "humantime_serde")]
    pub ttft_slack: Option<Duration>,
}

fn d_least_cached() -> bool {
    DEFAULT_LEAST_CACHED
}

/// Whether the least-cached layer is on when `least_cached` is not given.
pub const DEFAULT_LEAST_CACHED: bool = true;

impl Default for LeastCachedSettings {
    fn default() -> Self {
        LeastCachedSettings {
            enabled: DEFAULT_LEAST_CACHED,
            ttft_tolerance: None,
            ttft_slack: None,
        }
    }
}

impl PrefixSettings {
    /// Whether the fixed load / waiting limits are used (instead of predicted TTFTs).
    pub fn fixed_limits(&self) -> bool {
        self.load_tolerance.is_some() || self.waiting_threshold.is_some()
    }
}

fn d_session_headers() -> Vec<String> {
    vec!["x-session-id".into(), "x-claude-code-session-id".into()]
}

pub(super) fn validate_scheduler(sc: &SchedulerConfig, p: &str, errs: &mut Vec<String>) {
    match sc {
        SchedulerConfig::Layered {
            affinity,
            prefix,
            least_cached,
        } => {
            if least_cached
                .ttft_tolerance
                .is_some_and(|t| !(t.is_finite() && t >= 0.0))
            {
                errs.push(format!("{p}.least_cached.ttft_tolerance: must be >= 0"));
            }
            if let Some(a) = affinity.as_ref().filter(|a| a.enabled) {
                if a.headers.is_empty() {
                    errs.push(format!(
                        "{p}.affinity.headers: at least one header is required"
                    ));
                }
                for (i, h) in a.headers.iter().enumerate() {
                    if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                        errs.push(format!(
                            "{p}.affinity.headers[{i}]: {h:?} is not a valid header name"
                        ));
                    }
                }
                if a.soft_max_load_ratio.is_some_and(|r| r.is_nan() || r < 1.0) {
                    errs.push(format!("{p}.affinity.soft_max_load_ratio: must be >= 1.0"));
                }
                if a.soft_max_load_ratio.is_some()
                    && (a.ttft_tolerance.is_some() || a.ttft_slack.is_some())
                {
                    errs.push(format!(
                        "{p}.affinity: soft_max_load_ratio (a fixed load limit) and ttft_tolerance / ttft_slack (predicted TTFT) exclude each other; keep one"
                    ));
                }
                if a.ttft_tolerance
                    .is_some_and(|t| !(t.is_finite() && t >= 0.0))
                {
                    errs.push(format!("{p}.affinity.ttft_tolerance: must be >= 0"));
                }
                if a.max_entries == 0 {
                    errs.push(format!("{p}.affinity.max_entries: must be at least 1"));
                }
                if a.ttl.is_zero() {
                    errs.push(format!("{p}.affinity.ttl: must be greater than 0"));
                }
            }
            let x = prefix;
            if x.min_hit_ratio.is_some_and(|r| !(0.0..=1.0).contains(&r)) {
                errs.push(format!("{p}.prefix.min_hit_ratio: must be in [0, 1]"));
            }
            if x.load_tolerance.is_some_and(|t| t.is_nan() || t < 0.0) {
                errs.push(format!("{p}.prefix.load_tolerance: must be >= 0"));
            }
            if x.ttft_tolerance
                .is_some_and(|t| !(t.is_finite() && t >= 0.0))
            {
                errs.push(format!("{p}.prefix.ttft_tolerance: must be >= 0"));
            }
            if x.fixed_limits() && (x.ttft_tolerance.is_some() || x.ttft_slack.is_some()) {
                errs.push(format!(
                    "{p}.prefix: load_tolerance / waiting_threshold (fixed limits) and ttft_tolerance / ttft_slack (predicted TTFT) exclude each other; keep one kind"
                ));
            }
        }
        SchedulerConfig::Policy(ps) => {
            validate_policy(ps, p, errs);
            for (i, x) in ps.plugins.iter().enumerate() {
                if matches!(x, PluginSettings::DecisionService { .. }) {
                    errs.push(format!(
                        "{p}.plugins[{i}]: decision-service chooses between a route's targets; use it in routes[].policy"
                    ));
                }
            }
        }
    }
}

fn yes() -> bool {
    true
}
fn d_true() -> bool {
    true
}
