//! The YAML configuration: what `tokengate serve -c FILE` reads and `tokengate check` validates.
//!
//! Parsing is strict: unknown keys are errors, and every error names its YAML path
//! (`services[1].instances[0].addr: invalid socket address "x"`). Structural errors come from
//! serde (with the path tracked by `serde_path_to_error`); semantic checks are done in
//! [`Config::validate`], which collects every problem instead of stopping at the first.

use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use tokengate_plugins::{AffinityMode, LbPolicy};

/// Default `max_body_bytes`: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Addresses the proxy listens on (OpenAI / Anthropic APIs). `127.0.0.1:0` picks a free port.
    #[serde(default = "default_listen")]
    pub listen: Vec<String>,
    /// Address of the admin listener (`/health`, `/metrics`, `/admin/instances`).
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    /// Worker threads of the proxy runtime (default: the number of CPUs).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Bearer token the admin listener requires for `/metrics` and `/admin/*` (`/health`
    /// stays open for probes). Absent: the admin listener is open (keep it on loopback).
    #[serde(default)]
    pub admin_token: Option<String>,
    /// Bearer keys clients must present. Empty: the gateway is open.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Largest request body accepted (bytes); larger requests get 413.
    #[serde(
        default = "default_max_body",
        deserialize_with = "crate::config_source::bytes"
    )]
    pub max_body_bytes: usize,
    /// Active health checks of every instance.
    #[serde(default)]
    pub health_check: HealthCheckSettings,
    /// Passive ejection of instances whose requests fail.
    #[serde(default)]
    pub passive_health: PassiveHealthSettings,
    /// On SIGTERM: stop accepting, then wait this long for in-flight requests.
    #[serde(default = "d_grace", with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Hot reload of this file: watching it, and how long a change must settle first.
    #[serde(default)]
    pub reload: ReloadSettings,
    /// Log lines as `text` (default) or `json` (one object per line; `TOKENGATE_LOG_FORMAT`
    /// overrides). Read at start.
    #[serde(default)]
    pub log_format: crate::logging::LogFormat,
    #[serde(default)]
    pub routing: Routing,
    #[serde(default)]
    pub timeouts: Timeouts,
    /// The served models, each a pool of engine instances.
    #[serde(default)]
    pub services: Vec<ServiceConfig>,
    /// Routes: a model name clients send that spreads over several services (targets).
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// OpenAI-compatible chat models the decision service can ask.
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// The prefix index of every service.
    #[serde(default)]
    pub prefix_index: PrefixIndexSettings,
    /// The predicted-TTFT model (its priors; the rates are learned per instance).
    #[serde(default)]
    pub cost_model: CostModelSettings,
    /// Gateways in other regions that take the requests this one cannot.
    #[serde(default)]
    pub global: GlobalSettings,
    /// Traffic mirroring: a sampled copy of requests sent to another endpoint, off the
    /// client's path. Absent: off.
    #[serde(default)]
    pub mirror: Option<MirrorSettings>,
    /// Split proxy: a share of requests (by weight, or by model prefix) goes to external
    /// OpenAI- or Anthropic-compatible APIs instead of our own services, with failover
    /// between them. Absent: every request is ours.
    #[serde(default)]
    pub split: Option<SplitSettings>,
}

/// Split proxy (`split:`). See [`crate::split`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitSettings {
    #[serde(default)]
    pub strategy: SplitStrategy,
    /// Exactly one `local: true` entry (our own services) and any number of external APIs.
    pub proxies: Vec<SplitProxy>,
}

/// How a request's entry is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitStrategy {
    /// By weight over the enabled entries (smooth weighted round-robin: exact shares).
    #[default]
    Weight,
    /// By the longest `prefix` matching the request's model (`*` alone: catch-all); no match
    /// goes to the local entry.
    Prefix,
}

/// Whether an entry takes part in failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitFailover {
    /// When it fails before the first response byte the request moves on to the next
    /// participating entry, and it takes requests other entries failed.
    Participate,
    /// Its failures are answered as they are; it takes no other entry's requests.
    None,
}

/// One entry of `split.proxies`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitProxy {
    /// Our own services (model routing and scheduling as without a split).
    #[serde(default)]
    pub local: bool,
    /// An external entry's name (metrics, `x-tokengate-reason`, `x-tokengate-instance`).
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// Base URL in the OpenAI SDK's convention (ends in `/v1`); the client's path after
    /// `/v1` is appended.
    #[serde(default)]
    pub address: Option<String>,
    /// Replaces the request's `model`; blank keeps it.
    #[serde(default)]
    pub model: String,
    /// Replaces the client's credentials towards this upstream (`Authorization: Bearer`, or
    /// `x-api-key` on Anthropic `/v1/messages` requests).
    #[serde(default)]
    pub api_key: Option<Secret>,
    #[serde(default = "d_split_weight")]
    pub weight: u32,
    /// Model prefix with an optional trailing `*`; `*` alone matches every model.
    #[serde(default)]
    pub prefix: Option<String>,
    /// Default: `participate` for external entries; the local entry may set `participate`
    /// to send what our services cannot take (no instance, throttled) to external entries.
    #[serde(default)]
    pub failover: Option<SplitFailover>,
    /// TLS towards an `https://` address (private CA, tests-only skip).
    #[serde(default)]
    pub tls: Option<TlsSettings>,
}

fn d_split_weight() -> u32 {
    1
}

fn d_true() -> bool {
    true
}

/// Traffic mirroring (`mirror:`): a share of planned requests is copied, asynchronously, to
/// another OpenAI-compatible endpoint; its answers are measured and thrown away. See
/// [`crate::mirror`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorSettings {
    /// Base URL (`http://` or `https://`); the client's path is appended.
    pub target: String,
    /// Blank: the mirrored body keeps its `model`; else the body's `model` is replaced.
    #[serde(default)]
    pub target_model: String,
    /// Percent of requests mirrored, 0–100 (fractions allowed, down to 0.01).
    #[serde(default = "d_mirror_ratio")]
    pub ratio: f64,
    /// Sent to the target as `Authorization: Bearer` (never logged, never in `/admin`).
    #[serde(default)]
    pub auth_token: Option<String>,
    /// Longest a mirrored request may take, from its send to its last response byte.
    #[serde(default = "d_mirror_timeout_ms")]
    pub timeout_ms: u64,
    /// One line per mirrored request on the `mirror` log target, next to the primary's figures.
    #[serde(default)]
    pub log: bool,
}

fn d_mirror_ratio() -> f64 {
    100.0
}
fn d_mirror_timeout_ms() -> u64 {
    5000
}

/// Global scheduling: when local instances cannot take a request (throttling would reject
/// it, the queue is full, no instance is available), it is forwarded to a member gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalSettings {
    /// This gateway's name, sent in the `x-tokengate-hop` header of forwarded requests.
    #[serde(default = "d_gateway_name")]
    pub name: String,
    /// Tried in order, skipping ones that are down or refused the request.
    #[serde(default)]
    pub members: Vec<MemberConfig>,
}

impl Default for GlobalSettings {
    fn default() -> Self {
        GlobalSettings {
            name: d_gateway_name(),
            members: Vec::new(),
        }
    }
}

fn d_gateway_name() -> String {
    "tokengate".into()
}

/// Another region's gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    pub name: String,
    /// Its proxy listener, e.g. `http://gw.eu-west.internal:8080` (a name or an IP; https
    /// with certificate checks).
    pub url: String,
    /// The API key it accepts from this gateway (sent as `Authorization: Bearer`; never
    /// logged).
    #[serde(default)]
    pub token: Option<String>,
}

/// Settings of the predicted-TTFT model: what it assumes before it has learned an instance.
#[derive(Debug, Clone, Deserialize)]
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
/// The default prefix layer (no `ttft_*`, `load_tolerance` or `waiting_threshold` given):
/// an instance holding the prefix is preferred while its in-flight load ≤ average × (1 +
/// this) ...
pub const DEFAULT_PREFIX_LOAD_TOLERANCE: f64 = 3.0;
/// ... and at most this many of its requests wait for their first token (the cap that binds:
/// with 4 instances or fewer none can exceed 4 × the average load; 16 → 4 → 2 each took a
/// hot-spot seed's p99 down on the agentic benchmark and left the others level,
/// `bench/results/tail-explore.md`) ...
pub const DEFAULT_PREFIX_WAITING_THRESHOLD: u64 = 2;
/// ... for a request with at least this share of its prompt cached there.
pub const DEFAULT_PREFIX_MIN_HIT: f64 = 0.1;

/// How instances of one service are chosen. Absent: the service's `load_balancing` alone.
#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
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
    /// rule). Absent: when its predicted TTFT is above the best × (1 + `ttft_tolerance`) +
    /// `ttft_slack`.
    #[serde(default)]
    pub soft_max_load_ratio: Option<f64>,
    /// See `soft_max_load_ratio` (default 0.25).
    #[serde(default)]
    pub ttft_tolerance: Option<f64>,
    /// See `soft_max_load_ratio` (default 25ms).
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

/// The prefix layer. By default an instance holding a prefix is preferred unless its load
/// exceeds `DEFAULT_PREFIX_LOAD_TOLERANCE` / `DEFAULT_PREFIX_WAITING_THRESHOLD`; with
/// `ttft_tolerance` / `ttft_slack` set, while its predicted TTFT stays within them of the best
/// candidate's; with `load_tolerance` or `waiting_threshold` set, the seed's fixed limits.
#[derive(Debug, Clone, Deserialize)]
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
    /// (default 2).
    #[serde(default)]
    pub waiting_threshold: Option<u64>,
    /// Preferred while its predicted TTFT ≤ best × (1 + this) + `ttft_slack` (default 0.5).
    #[serde(default)]
    pub ttft_tolerance: Option<f64>,
    /// See `ttft_tolerance` (default 50ms).
    #[serde(default, with = "humantime_serde")]
    pub ttft_slack: Option<Duration>,
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
#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySettings {
    /// Scoring plugins and their weights.
    pub plugins: Vec<PluginSettings>,
    /// Where the session key comes from, first present wins: `header:NAME` or
    /// `body:prompt_cache_key` / `body:user` / `body:metadata.user_id` (body keys count only
    /// on /v1/responses and /v1/messages).
    #[serde(default = "d_session_chain")]
    pub session_keys: Vec<KeySource>,
    /// Session binding lifetime.
    #[serde(default = "d_session_ttl", with = "humantime_serde")]
    pub session_ttl: Duration,
    /// Most session bindings kept; the least recently used are evicted.
    #[serde(default = "d_max_entries")]
    pub session_max_entries: usize,
}

/// What `session-affinity` scores for a session that is not bound to a candidate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnboundSessions {
    /// A fixed per-session order of the instances (rendezvous hash).
    #[default]
    Rendezvous,
    /// No score: the other plugins decide.
    Abstain,
}

/// A policy plugin: `kind` names it, the other keys are its own parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PluginSettings {
    /// `2^-rank` in the session's preference order (bound instance first).
    SessionAffinity {
        #[serde(default)]
        weight: Option<f64>,
        /// A session with no binding (or bound to an instance that is not a candidate):
        /// `rendezvous` (default) ranks the instances by a per-session hash; `abstain` scores
        /// nothing, so the other plugins place it (where its tenant's prefix is cached, …).
        #[serde(default)]
        unbound: UnboundSessions,
    },
    /// `1 / (1 + in-flight requests)`.
    LeastInflight {
        #[serde(default)]
        weight: Option<f64>,
    },
    /// `1 / (1 + in-flight tokens / token_scale)`.
    LeastToken {
        #[serde(default)]
        weight: Option<f64>,
        /// Tokens that weigh as much as one request does for least-inflight (default 1000).
        #[serde(default = "d_token_scale")]
        token_scale: f64,
    },
    /// `best / est`: the predicted time to first token relative to the best candidate's; with
    /// `temperature`, `exp(-(est - best) / temperature)` instead. With `tolerance` / `slack`,
    /// every candidate within best × (1 + tolerance) + slack scores 1 and that limit takes
    /// the place of `best` beyond it.
    PredictedTtft {
        #[serde(default)]
        weight: Option<f64>,
        /// How many milliseconds slower make a candidate e (2.718…) times less attractive:
        /// small differences barely count, large ones dominate. Unset: `best / est`.
        #[serde(default, with = "humantime_serde")]
        temperature: Option<Duration>,
        /// Room above the best estimate in which candidates tie (score 1), as a share of it
        /// (e.g. 0.5). Unset (and no `slack`): no room.
        #[serde(default)]
        tolerance: Option<f64>,
        /// Absolute room added to `tolerance` (e.g. 50ms).
        #[serde(default, with = "humantime_serde")]
        slack: Option<Duration>,
        /// `true`: candidates beyond the room are removed before any plugin scores (the other
        /// plugins choose among the rest, whatever their weights), and the score ranks those
        /// left from the best (no plateau). Without `tolerance` / `slack` only the best stays.
        #[serde(default)]
        filter: bool,
    },
    /// `2^-r`, `r` = how many candidates hold fewer cached blocks (by the prefix index).
    LeastCached {
        #[serde(default)]
        weight: Option<f64>,
    },
    /// Share of the prompt cached on the instance; matches below `min_hit_ratio` score 0, and
    /// so does an instance with more than `max_waiting` requests waiting for their first token.
    PrefixCache {
        #[serde(default)]
        weight: Option<f64>,
        #[serde(default = "d_min_hit")]
        min_hit_ratio: f64,
        /// Unset: no limit.
        #[serde(default)]
        max_waiting: Option<u64>,
    },
    /// Routes only: ask the route's decision model which target fits; its answer restricts
    /// the candidates to that target (a filter, so it has no weight).
    DecisionService {
        /// Rejected with an explanation (a filter has no weight); kept so that the error
        /// names it instead of "unknown field".
        #[serde(default)]
        weight: Option<f64>,
    },
}

impl PluginSettings {
    /// The config name.
    pub fn kind(&self) -> &'static str {
        match self {
            PluginSettings::SessionAffinity { .. } => "session-affinity",
            PluginSettings::LeastInflight { .. } => "least-inflight",
            PluginSettings::LeastToken { .. } => "least-token",
            PluginSettings::PredictedTtft { .. } => "predicted-ttft",
            PluginSettings::LeastCached { .. } => "least-cached",
            PluginSettings::PrefixCache { .. } => "prefix-cache",
            PluginSettings::DecisionService { .. } => "decision-service",
        }
    }

    /// The configured weight (`None`: default 1).
    pub fn weight(&self) -> Option<f64> {
        match self {
            PluginSettings::SessionAffinity { weight, .. }
            | PluginSettings::LeastInflight { weight }
            | PluginSettings::LeastToken { weight, .. }
            | PluginSettings::PredictedTtft { weight, .. }
            | PluginSettings::LeastCached { weight }
            | PluginSettings::PrefixCache { weight, .. }
            | PluginSettings::DecisionService { weight } => *weight,
        }
    }
}

/// Where a session key is read from: `header:NAME` (case-insensitive), or a body field
/// (`body:prompt_cache_key`, `body:user`, `body:metadata.user_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header, lower-cased.
    Header(String),
    PromptCacheKey,
    User,
    MetadataUserId,
}

impl KeySource {
    fn parse(s: &str) -> Result<KeySource, String> {
        if let Some(h) = s.strip_prefix("header:") {
            if h.is_empty() || http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return Err(format!("{s:?}: not a valid header name"));
            }
            return Ok(KeySource::Header(h.to_ascii_lowercase()));
        }
        match s {
            "body:prompt_cache_key" => Ok(KeySource::PromptCacheKey),
            "body:user" => Ok(KeySource::User),
            "body:metadata.user_id" => Ok(KeySource::MetadataUserId),
            _ => Err(format!(
                "{s:?} is not header:NAME, body:prompt_cache_key, body:user or body:metadata.user_id"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for KeySource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        KeySource::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Settings of the prefix index (shared by layered and policy schedulers).
#[derive(Debug, Clone, Deserialize)]
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
    #[serde(default, deserialize_with = "crate::config_source::opt_bytes")]
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

/// A model name that spreads over several services.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The `model` clients send, e.g. `qwen3`.
    pub name: String,
    pub targets: Vec<TargetConfig>,
    /// `round-robin` (the targets in turn), `weight` (each target's weight is its share of
    /// traffic), or `policy` (scoring across every target's instances). Default: `policy`
    /// when `policy` is set, else `weight` when any target has a weight, else `round-robin`.
    #[serde(default)]
    pub route_by: Option<RouteBy>,
    #[serde(default)]
    pub policy: Option<PolicySettings>,
    /// The decision service, used by a `decision-service` plugin.
    #[serde(default)]
    pub decision: Option<DecisionSettings>,
}

/// How a route spreads over its targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouteBy {
    RoundRobin,
    Weight,
    Policy,
}

impl RouteBy {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteBy::RoundRobin => "round-robin",
            RouteBy::Weight => "weight",
            RouteBy::Policy => "policy",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// A service name.
    pub service: String,
    /// Share of the route's traffic in `weight` mode.
    #[serde(default)]
    pub weight: Option<u32>,
    /// What requests fit this target, for the decision service (generated when absent).
    #[serde(default)]
    pub criteria: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionSettings {
    /// A provider name from `providers`.
    pub provider: String,
    /// The model to ask; default: the provider's `model`.
    #[serde(default)]
    pub model: Option<String>,
    /// What the decision model is told before the targets' criteria.
    #[serde(default = "d_instructions")]
    pub instructions: String,
    /// Longest wait for an answer; past it the plugin abstains.
    #[serde(default = "d_decision_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

/// An OpenAI-compatible chat model endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub name: String,
    /// Base URL up to `/v1`, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    #[serde(default)]
    pub api_key: Option<String>,
    /// The model routes ask by default, e.g. `jev-latest` (a route's `decision.model`
    /// overrides it).
    #[serde(default)]
    pub model: Option<String>,
}

fn d_session_headers() -> Vec<String> {
    vec!["x-session-id".into(), "x-claude-code-session-id".into()]
}
fn d_session_chain() -> Vec<KeySource> {
    vec![
        KeySource::Header("session-id".into()),
        KeySource::Header("x-client-request-id".into()),
        KeySource::PromptCacheKey,
    ]
}
fn d_session_ttl() -> Duration {
    Duration::from_secs(1800)
}
fn d_max_entries() -> usize {
    100_000
}
fn d_token_scale() -> f64 {
    1000.0
}
fn d_min_hit() -> f64 {
    0.5
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
fn d_instructions() -> String {
    "You route requests to the model that fits them best: the smallest model that can answer well."
        .into()
}
fn d_decision_timeout() -> Duration {
    Duration::from_secs(2)
}

/// Active health checks: `GET path` on every instance every `interval`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckSettings {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "d_health_path")]
    pub path: String,
    #[serde(default = "d_health_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default = "d_health_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Consecutive successes that make an unhealthy instance healthy.
    #[serde(default = "d_rise")]
    pub rise: u32,
    /// Consecutive failures that make a healthy instance unhealthy.
    #[serde(default = "d_fall")]
    pub fall: u32,
}

impl Default for HealthCheckSettings {
    fn default() -> Self {
        HealthCheckSettings {
            enabled: true,
            path: d_health_path(),
            interval: d_health_interval(),
            timeout: d_health_timeout(),
            rise: d_rise(),
            fall: d_fall(),
        }
    }
}

/// Passive health: how the outcome of real requests acts on instances. `max_failures`
/// consecutive failed requests (connect failure, 5xx, timeout, died mid-response) eject an
/// instance for `eject_for` (0 disables ejection).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassiveHealthSettings {
    #[serde(default = "d_max_failures")]
    pub max_failures: u32,
    #[serde(default = "d_eject_for", with = "humantime_serde")]
    pub eject_for: Duration,
    /// Engine statuses retried on another instance (never the same one twice, within the 3
    /// attempts a request has, body replayed exactly) when they arrive before any response
    /// byte reached the client. Default `[503, 429]`; `[]` passes every engine answer
    /// through. Retried 5xx count as failures for ejection; 429 (the engine is busy, not
    /// broken) does not. With no other instance left the engine's answer is passed through.
    #[serde(default = "d_retry_on_status")]
    pub retry_on_status: Vec<u16>,
}

impl Default for PassiveHealthSettings {
    fn default() -> Self {
        PassiveHealthSettings {
            max_failures: d_max_failures(),
            eject_for: d_eject_for(),
            retry_on_status: d_retry_on_status(),
        }
    }
}

fn d_health_path() -> String {
    "/health".into()
}
fn d_health_interval() -> Duration {
    Duration::from_secs(2)
}
fn d_health_timeout() -> Duration {
    Duration::from_secs(2)
}
fn d_rise() -> u32 {
    2
}
fn d_fall() -> u32 {
    3
}
fn d_max_failures() -> u32 {
    3
}
fn d_eject_for() -> Duration {
    Duration::from_secs(10)
}
fn d_retry_on_status() -> Vec<u16> {
    vec![503, 429]
}

/// How a request's `model` is matched to a service.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Routing {
    /// `true`: a model that matches no service is a 404. `false`: it goes to `default_model`.
    #[serde(default = "yes")]
    pub strict: bool,
    /// The service used for unknown models when `strict` is false; the request's `model` is
    /// rewritten to this name before it is forwarded.
    #[serde(default)]
    pub default_model: Option<String>,
}

impl Default for Routing {
    fn default() -> Self {
        Routing {
            strict: true,
            default_model: None,
        }
    }
}

/// Hot reload (see [`crate::reload`]). SIGHUP always reloads; these settings govern the
/// file watcher.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadSettings {
    /// Reload when the file changes (checked four times a second). `false`: SIGHUP only.
    #[serde(default = "d_true")]
    pub watch: bool,
    /// A file changed in place is applied only once its size and modification time have
    /// not moved for this long, so a file still being written (truncated, then filled) is
    /// never read half-way. A file replaced by a rename or a symlink swap (editors'
    /// atomic saves, a Kubernetes ConfigMap) is complete when it appears and applies at the
    /// next check.
    #[serde(default = "d_debounce", with = "humantime_serde")]
    pub debounce: Duration,
}

fn d_debounce() -> Duration {
    Duration::from_secs(2)
}

impl Default for ReloadSettings {
    fn default() -> Self {
        ReloadSettings {
            watch: true,
            debounce: d_debounce(),
        }
    }
}

/// Upstream timeouts (humantime strings: `500ms`, `2s`, `10m`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to an engine.
    #[serde(default = "d_connect", with = "humantime_serde")]
    pub connect: Duration,
    /// From the request being sent to the response header (prefill + queueing).
    #[serde(default = "d_first_byte", with = "humantime_serde")]
    pub first_byte: Duration,
    /// Longest silence between two response chunks once the response has started.
    #[serde(default = "d_idle", with = "humantime_serde")]
    pub idle: Duration,
    /// Whole request, checked at every response chunk.
    #[serde(default = "d_total", with = "humantime_serde")]
    pub total: Duration,
    /// Longest time to receive a client's whole request body (and longest silence between
    /// two of its reads); a slower upload is answered 408 and the connection closed.
    #[serde(default = "d_client_body", with = "humantime_serde")]
    pub client_body: Duration,
    /// Longest time from a request's first byte to the end of its head (request line and
    /// headers); a slower client (slowloris) is answered 408 and the connection closed.
    #[serde(default = "d_client_head", with = "humantime_serde")]
    pub client_head: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: d_connect(),
            first_byte: d_first_byte(),
            idle: d_idle(),
            total: d_total(),
            client_body: d_client_body(),
            client_head: d_client_head(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// The model name clients send (`"model": "qwen3-32b"`).
    pub name: String,
    /// `least-token`, `least-request`, `round-robin` or `predicted-ttft`. Default:
    /// `predicted-ttft` under a layered scheduler, else `least-token`.
    #[serde(default)]
    pub load_balancing: Option<LbPolicy>,
    /// Layered or policy scheduling; absent = `load_balancing` alone.
    #[serde(default)]
    pub scheduler: Option<SchedulerConfig>,
    /// Scrape the engines' own load figures from their Prometheus metrics (vLLM or SGLang
    /// names); absent = off.
    #[serde(default)]
    pub engine_metrics: Option<EngineMetricsSettings>,
    /// Slot limits per instance or per service, and what happens beyond them; absent = off.
    #[serde(default)]
    pub throttling: Option<ThrottlingSettings>,
    /// Prefill/decode disaggregation: the instances have roles (`prefill` / `decode`);
    /// absent = integrated engines.
    #[serde(default)]
    pub pd: Option<PdSettings>,
    /// The engines' API key (their `--api-key`), sent as `Authorization: Bearer` to every
    /// instance without its own.
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// TLS towards the instances addressed by `https://` URLs.
    #[serde(default)]
    pub tls: Option<TlsSettings>,
    pub instances: Vec<InstanceConfig>,
}

/// Request throttling (see [`crate::throttle`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThrottlingSettings {
    /// `reject` (429 at once) or `queue` (FIFO, up to `max_queue`, for `queue_timeout`).
    #[serde(default)]
    pub overflow: crate::throttle::Overflow,
    /// `instance` (each instance alone) or `service` (the combined load against the limit ×
    /// the number of instances).
    #[serde(default)]
    pub scope: crate::throttle::Scope,
    /// Requests from dispatch to completion per instance (integrated instances); 0 = none.
    #[serde(default)]
    pub total: u64,
    /// Requests from dispatch to their first token per instance; 0 = none.
    #[serde(default)]
    pub prefill: u64,
    /// Requests from their first token to completion per decode node of a prefill/decode
    /// disaggregated service; 0 = none.
    #[serde(default)]
    pub decode: u64,
    /// Queue mode: a longer queue rejects (429).
    #[serde(default = "d_max_queue")]
    pub max_queue: usize,
    /// Queue mode: a request that waited this long gets 503.
    #[serde(default = "d_queue_timeout", with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// `Retry-After` of a 429.
    #[serde(default = "d_retry_after", with = "humantime_serde")]
    pub retry_after: Duration,
}

fn d_max_queue() -> usize {
    1000
}
fn d_queue_timeout() -> Duration {
    Duration::from_secs(30)
}
fn d_retry_after() -> Duration {
    Duration::from_secs(1)
}

/// `GET path` on every instance of the service every `interval`: running and queued
/// requests and KV usage, shown in `/admin/instances` and read by the predicted-TTFT model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineMetricsSettings {
    #[serde(default = "d_em_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default = "d_em_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    #[serde(default = "d_em_path")]
    pub path: String,
    /// `true`: an instance without `cache_tokens` takes the KV cache size its engine reports
    /// (`vllm:cache_config_info`, `sglang:max_total_num_tokens`) as its `cache_tokens`.
    #[serde(default)]
    pub cache_size: bool,
}

fn d_em_interval() -> Duration {
    Duration::from_secs(1)
}
fn d_em_timeout() -> Duration {
    Duration::from_millis(500)
}
fn d_em_path() -> String {
    "/metrics".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceConfig {
    /// Unique id, shown in `x-tokengate-instance`, metrics and logs.
    pub id: String,
    /// The engine's HTTP server: `ip:port`, or `host:port` resolved at load (see
    /// [`crate::resolve`]).
    pub addr: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// `prefill` or `decode` in a prefill/decode-disaggregated service (`services[].pd`).
    #[serde(default)]
    pub role: Option<InstanceRole>,
    /// SGLang prefill instances: the engine's `--disaggregation-bootstrap-port`, sent to the
    /// decode instance as `bootstrap_port` (`pd.mode: sglang-mooncake`).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// The engine's API key (its `--api-key`), sent as `Authorization: Bearer`; overrides
    /// the service's.
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// The engine's KV cache size in tokens (vLLM: `num_gpu_blocks` × `block_size` in its
    /// startup log or `vllm:cache_config_info`; SGLang: `max_total_num_tokens`). When given, the
    /// prefix index never believes this instance holds more than that: once it does, the
    /// instance's least recently used entries leave the index, as the engine evicts them.
    #[serde(default)]
    pub cache_tokens: Option<u64>,
}

/// A credential from the config: never printed (its `Debug` is `***`), never in errors,
/// logs, metrics or `/admin`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

impl Secret {
    /// Usable as a Bearer token (the error never shows the key).
    pub fn check(&self) -> Result<(), String> {
        if self.0.is_empty() || self.0.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("must be non-empty, without whitespace or control characters".into());
        }
        Ok(())
    }

    /// `Bearer <key>` as a header value marked sensitive (HTTP/2 never indexes it, `Debug`
    /// hides it).
    pub fn bearer(&self) -> Option<http::HeaderValue> {
        let mut v = http::HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()?;
        v.set_sensitive(true);
        Some(v)
    }
}

pub use crate::tls::TlsSettings;

/// An instance's part in a prefill/decode-disaggregated service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InstanceRole {
    Prefill,
    Decode,
}

impl InstanceRole {
    pub fn plugin_role(self) -> tokengate_plugins::Role {
        match self {
            InstanceRole::Prefill => tokengate_plugins::Role::Prefill,
            InstanceRole::Decode => tokengate_plugins::Role::Decode,
        }
    }
}

/// Prefill/decode disaggregation of a service (see [`crate::request::pd`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PdSettings {
    /// The engines' KV hand-over protocol.
    pub mode: PdMode,
    /// How the decode instance is chosen (the service's scheduler chooses the prefill
    /// instance): `least-token`, `least-request` or `round-robin`.
    #[serde(default = "d_decode_policy")]
    pub decode_policy: LbPolicy,
}

fn d_decode_policy() -> LbPolicy {
    LbPolicy::LeastToken
}

/// The KV hand-over protocol of a prefill/decode-disaggregated service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PdMode {
    /// SGLang with Mooncake: `bootstrap_host` / `bootstrap_port` / `bootstrap_room` in the
    /// body, sent to the prefill and the decode instance at once.
    SglangMooncake,
    /// vLLM with NIXL: the prefill first (`max_tokens: 1`, `kv_transfer_params`), then the
    /// decode with the `kv_transfer_params` the prefill returned.
    VllmNixl,
}

impl PdMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PdMode::SglangMooncake => "sglang-mooncake",
            PdMode::VllmNixl => "vllm-nixl",
        }
    }
}

fn yes() -> bool {
    true
}
fn default_listen() -> Vec<String> {
    vec!["127.0.0.1:8080".into()]
}
fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}
fn default_max_body() -> usize {
    DEFAULT_MAX_BODY_BYTES
}
fn d_grace() -> Duration {
    Duration::from_secs(30)
}
fn d_connect() -> Duration {
    Duration::from_secs(3)
}
fn d_first_byte() -> Duration {
    Duration::from_secs(120)
}
fn d_idle() -> Duration {
    Duration::from_secs(60)
}
fn d_total() -> Duration {
    Duration::from_secs(1800)
}
fn d_client_body() -> Duration {
    Duration::from_secs(60)
}
fn d_client_head() -> Duration {
    Duration::from_secs(10)
}

/// Every problem found in a config file, each `path: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<String>);

impl std::fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigErrors(vec![format!("{}: cannot read: {e}", path.display())]))?;
        Config::from_yaml(&text)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        crate::config_report::parse(text, |c: &Config| c.validate().map_err(|e| e.0))
            .map_err(ConfigErrors)
    }

    /// Semantic checks; collects every error.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut errs = Vec::new();
        if self.listen.is_empty() {
            errs.push("listen: at least one address is required".to_string());
        }
        for (i, l) in self.listen.iter().enumerate() {
            if l.parse::<SocketAddr>().is_err() {
                errs.push(format!(
                    "listen[{i}]: invalid socket address {l:?} (expected ip:port, e.g. 0.0.0.0:8080)"
                ));
            }
        }
        if self.admin_listen.parse::<SocketAddr>().is_err() {
            errs.push(format!(
                "admin_listen: invalid socket address {:?} (expected ip:port, e.g. 127.0.0.1:9090)",
                self.admin_listen
            ));
        }
        if self.threads == Some(0) {
            errs.push("threads: must be at least 1".into());
        }
        if self.reload.debounce > Duration::from_secs(600) {
            errs.push(format!(
                "reload.debounce: {} is longer than the 10m allowed (a change would wait that long to apply)",
                humantime::format_duration(self.reload.debounce)
            ));
        }
        if self.max_body_bytes == 0 {
            errs.push("max_body_bytes: must be greater than 0".into());
        }
        for (i, k) in self.api_keys.iter().enumerate() {
            if k.trim().is_empty() || k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                errs.push(format!(
                    "api_keys[{i}]: must be non-empty and contain no whitespace"
                ));
            }
        }
        let t = &self.timeouts;
        for (name, d) in [
            ("connect", t.connect),
            ("first_byte", t.first_byte),
            ("idle", t.idle),
            ("total", t.total),
            ("client_body", t.client_body),
            ("client_head", t.client_head),
        ] {
            if d.is_zero() {
                errs.push(format!("timeouts.{name}: must be greater than 0"));
            }
        }
        if self.services.is_empty() {
            errs.push("services: at least one service is required".into());
        }
        let mut names = HashSet::new();
        let mut ids = HashSet::new();
        for (si, s) in self.services.iter().enumerate() {
            if s.name.is_empty() {
                errs.push(format!("services[{si}].name: must not be empty"));
            }
            if !names.insert(s.name.as_str()) {
                errs.push(format!(
                    "services[{si}].name: duplicate service {:?}",
                    s.name
                ));
            }
            if s.instances.is_empty() {
                errs.push(format!(
                    "services[{si}].instances: at least one instance is required"
                ));
            }
            for (ii, inst) in s.instances.iter().enumerate() {
                let p = format!("services[{si}].instances[{ii}]");
                if inst.id.is_empty() {
                    errs.push(format!("{p}.id: must not be empty"));
                } else if !ids.insert(inst.id.as_str()) {
                    errs.push(format!("{p}.id: duplicate instance id {:?}", inst.id));
                } else if http::HeaderValue::from_str(&inst.id).is_err() {
                    errs.push(format!(
                        "{p}.id: {:?} cannot be sent in the x-tokengate-instance header (use visible ASCII)",
                        inst.id
                    ));
                }
                if let Err(e) = crate::resolve::target(&inst.addr) {
                    errs.push(format!("{p}.addr: {e}"));
                }
                if let Some(k) = &inst.api_key {
                    if let Err(e) = k.check() {
                        errs.push(format!("{p}.api_key: {e}"));
                    }
                }
                if let Some(t) = inst.cache_tokens {
                    let block = self.prefix_index.block_size.max(1) as u64;
                    if t < block {
                        errs.push(format!(
                            "{p}.cache_tokens: {t} is less than one prefix block (prefix_index.block_size: {block}); give the engine's KV cache size in tokens"
                        ));
                    }
                }
            }
        }
        for (si, s) in self.services.iter().enumerate() {
            if let Some(sc) = &s.scheduler {
                validate_scheduler(sc, &format!("services[{si}].scheduler"), &mut errs);
            }
            if let Some(t) = &s.throttling {
                let p = format!("services[{si}].throttling");
                if t.decode > 0 && s.pd.is_none() {
                    errs.push(format!(
                        "{p}.decode: counts decode nodes of a prefill/decode-disaggregated service; services[{si}] has none (use prefill and total)"
                    ));
                }
                if t.total > 0 && s.pd.is_some() {
                    errs.push(format!(
                        "{p}.total: not counted in a prefill/decode-disaggregated service (use prefill for the prefill nodes and decode for the decode nodes)"
                    ));
                }
                if t.prefill == 0 && t.total == 0 && t.decode == 0 {
                    errs.push(format!(
                        "{p}: set at least one limit (prefill, total or decode); 0 means no limit"
                    ));
                }
                if t.overflow == crate::throttle::Overflow::Queue {
                    if t.max_queue == 0 {
                        errs.push(format!("{p}.max_queue: must be at least 1 in queue mode"));
                    }
                    if t.queue_timeout.is_zero() {
                        errs.push(format!("{p}.queue_timeout: must be greater than 0"));
                    }
                }
            }
            validate_pd(si, s, &mut errs);
            if let Some(k) = &s.api_key {
                if let Err(e) = k.check() {
                    errs.push(format!("services[{si}].api_key: {e}"));
                }
            }
            if let Some(t) = &s.tls {
                if let Err(e) = crate::tls::check(t) {
                    errs.push(format!("services[{si}].tls.{e}"));
                }
            }
            if let Some(em) = &s.engine_metrics {
                if em.interval.is_zero() || em.timeout.is_zero() {
                    errs.push(format!(
                        "services[{si}].engine_metrics.interval / timeout: must be greater than 0"
                    ));
                }
                if !em.path.starts_with('/') {
                    errs.push(format!(
                        "services[{si}].engine_metrics.path: {:?} must start with /",
                        em.path
                    ));
                }
            }
        }
        let hc = &self.health_check;
        if !hc.path.starts_with('/') {
            errs.push(format!(
                "health_check.path: {:?} must start with /",
                hc.path
            ));
        }
        if hc.interval.is_zero() || hc.timeout.is_zero() {
            errs.push("health_check.interval / timeout: must be greater than 0".into());
        }
        if hc.rise == 0 || hc.fall == 0 {
            errs.push("health_check.rise / fall: must be at least 1".into());
        }
        for (i, &code) in self.passive_health.retry_on_status.iter().enumerate() {
            if !(code == 408 || code == 429 || (500..=599).contains(&code)) {
                errs.push(format!(
                    "passive_health.retry_on_status[{i}]: {code} cannot be retried (expected 408, 429 or 5xx)"
                ));
            }
        }
        let pi = &self.prefix_index;
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
        let mut members = HashSet::new();
        if http::HeaderValue::from_str(&self.global.name).is_err() || self.global.name.is_empty() {
            errs.push("global.name: must be a non-empty header value (visible ASCII)".into());
        }
        for (i, m) in self.global.members.iter().enumerate() {
            let p = format!("global.members[{i}]");
            if m.name.is_empty() || http::HeaderValue::from_str(&m.name).is_err() {
                errs.push(format!(
                    "{p}.name: must be a non-empty header value (visible ASCII)"
                ));
            } else if !members.insert(m.name.as_str()) {
                errs.push(format!("{p}.name: duplicate member {:?}", m.name));
            }
            if let Err(e) = crate::upstream::parse_url(&m.url) {
                errs.push(format!("{p}.url: {e}"));
            }
            if let Some(t) = &m.token {
                if t.is_empty() || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    errs.push(format!("{p}.token: must be non-empty without whitespace"));
                }
            }
        }
        if let Some(m) = &self.mirror {
            if let Err(e) = crate::upstream::parse_url(&m.target) {
                errs.push(format!("mirror.target: {e}"));
            }
            if !(m.ratio.is_finite() && (0.0..=100.0).contains(&m.ratio)) {
                errs.push(format!(
                    "mirror.ratio: {} is not a percentage (expected 0 to 100)",
                    m.ratio
                ));
            }
            if m.timeout_ms == 0 {
                errs.push("mirror.timeout_ms: must be greater than 0".into());
            }
            if let Some(t) = &m.auth_token {
                if t.is_empty() || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    errs.push("mirror.auth_token: must be non-empty without whitespace".into());
                }
            }
            if m.target_model.chars().any(char::is_control) {
                errs.push("mirror.target_model: must not contain control characters".into());
            }
        }
        if let Some(sp) = &self.split {
            validate_split(sp, &mut errs);
        }
        let cm = &self.cost_model;
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
        let mut pnames = HashSet::new();
        for (pi, p) in self.providers.iter().enumerate() {
            if !pnames.insert(p.name.as_str()) {
                errs.push(format!(
                    "providers[{pi}].name: duplicate provider {:?}",
                    p.name
                ));
            }
            if !(p.base_url.starts_with("http://") || p.base_url.starts_with("https://")) {
                errs.push(format!(
                    "providers[{pi}].base_url: {:?} must start with http:// or https://",
                    p.base_url
                ));
            }
        }
        let pd_services: HashSet<&str> = self
            .services
            .iter()
            .filter(|s| s.pd.is_some())
            .map(|s| s.name.as_str())
            .collect();
        let mut rnames = HashSet::new();
        for (ri, r) in self.routes.iter().enumerate() {
            let p = format!("routes[{ri}]");
            if r.name.is_empty() {
                errs.push(format!("{p}.name: must not be empty"));
            } else if names.contains(r.name.as_str()) {
                errs.push(format!(
                    "{p}.name: {:?} is already a service name; a model name is either a service or a route",
                    r.name
                ));
            } else if !rnames.insert(r.name.as_str()) {
                errs.push(format!("{p}.name: duplicate route {:?}", r.name));
            }
            if r.targets.is_empty() {
                errs.push(format!("{p}.targets: at least one target is required"));
            }
            let mut seen = HashSet::new();
            for (ti, t) in r.targets.iter().enumerate() {
                if !names.contains(t.service.as_str()) {
                    errs.push(format!(
                        "{p}.targets[{ti}].service: {:?} is not the name of a service",
                        t.service
                    ));
                } else if !seen.insert(t.service.as_str()) {
                    errs.push(format!(
                        "{p}.targets[{ti}].service: {:?} is listed twice",
                        t.service
                    ));
                }
            }
            match r.route_by() {
                RouteBy::Weight => {
                    for (ti, t) in r.targets.iter().enumerate() {
                        if t.weight.is_none() {
                            errs.push(format!(
                                "{p}.targets[{ti}].weight: required when route_by is weight"
                            ));
                        }
                    }
                    if r.targets.iter().all(|t| t.weight.unwrap_or(0) == 0) {
                        errs.push(format!("{p}.targets: at least one weight must be positive"));
                    }
                }
                RouteBy::Policy
                    if r.targets
                        .iter()
                        .any(|t| pd_services.contains(t.service.as_str())) =>
                {
                    errs.push(format!(
                        "{p}.route_by: policy schedules across the targets' instances, which cannot include a prefill/decode-disaggregated service (use weight or round-robin: the target's own scheduler then picks the pair)"
                    ));
                }
                RouteBy::Policy => match &r.policy {
                    None => errs.push(format!("{p}.policy: required when route_by is policy")),
                    Some(ps) => {
                        validate_policy(ps, &format!("{p}.policy"), &mut errs);
                        if r.uses_decision() && r.decision.is_none() {
                            errs.push(format!(
                                "{p}.decision: required by the decision-service plugin"
                            ));
                        }
                    }
                },
                RouteBy::RoundRobin => {}
            }
            if r.policy.is_some() && r.route_by() != RouteBy::Policy {
                errs.push(format!(
                    "{p}.policy: only used when route_by is policy (it is {})",
                    r.route_by().as_str()
                ));
            }
            if let Some(d) = &r.decision {
                if !pnames.contains(d.provider.as_str()) {
                    errs.push(format!(
                        "{p}.decision.provider: {:?} is not the name of a provider",
                        d.provider
                    ));
                }
                if d.timeout.is_zero() {
                    errs.push(format!("{p}.decision.timeout: must be greater than 0"));
                }
                let provider_model = self
                    .providers
                    .iter()
                    .find(|x| x.name == d.provider)
                    .and_then(|x| x.model.as_deref());
                if pnames.contains(d.provider.as_str())
                    && d.model
                        .as_deref()
                        .or(provider_model)
                        .is_none_or(str::is_empty)
                {
                    errs.push(format!(
                        "{p}.decision.model: required (provider {:?} names no model)",
                        d.provider
                    ));
                }
            }
        }
        match (&self.routing.strict, &self.routing.default_model) {
            (true, Some(_)) => errs.push(
                "routing.default_model: only used when routing.strict is false; set strict: false or remove it"
                    .into(),
            ),
            (false, None) => errs.push(
                "routing.default_model: required when routing.strict is false".into(),
            ),
            (false, Some(m)) if !names.contains(m.as_str()) => errs.push(format!(
                "routing.default_model: {m:?} is not the name of a service"
            )),
            _ => {}
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errs))
        }
    }

    /// Things that are valid but probably not what was meant; logged at start and reload,
    /// printed by `tokengate check`.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if let Some(m) = &self.mirror {
            if m.ratio > 0.0 && m.ratio < 0.01 {
                w.push(format!(
                    "mirror.ratio: {} is below the sampling resolution (0.01 percent); nothing is mirrored",
                    m.ratio
                ));
            }
        }
        for (ri, r) in self.routes.iter().enumerate() {
            if r.decision.is_some() && !r.uses_decision() {
                w.push(format!(
                    "routes[{ri}].decision: set, but no decision-service plugin in routes[{ri}].policy.plugins uses it; the decision model is never asked"
                ));
            }
        }
        w
    }
}

impl RouteConfig {
    /// The effective `route_by`.
    pub fn route_by(&self) -> RouteBy {
        match self.route_by {
            Some(m) => m,
            None if self.policy.is_some() => RouteBy::Policy,
            None if self.targets.iter().any(|t| t.weight.is_some()) => RouteBy::Weight,
            None => RouteBy::RoundRobin,
        }
    }

    /// Whether the route's policy has a decision-service plugin (and so asks its decision
    /// model).
    pub fn uses_decision(&self) -> bool {
        self.route_by() == RouteBy::Policy
            && self.policy.as_ref().is_some_and(|ps| {
                ps.plugins
                    .iter()
                    .any(|x| matches!(x, PluginSettings::DecisionService { .. }))
            })
    }
}

/// Roles and bootstrap ports of a service's instances against its `pd` settings.
fn validate_pd(si: usize, s: &ServiceConfig, errs: &mut Vec<String>) {
    let Some(pd) = &s.pd else {
        for (ii, i) in s.instances.iter().enumerate() {
            let p = format!("services[{si}].instances[{ii}]");
            if i.role.is_some() {
                errs.push(format!(
                    "{p}.role: instances have roles only in a prefill/decode-disaggregated service; set services[{si}].pd (mode: sglang-mooncake or vllm-nixl)"
                ));
            }
            if i.bootstrap_port.is_some() {
                errs.push(format!(
                    "{p}.bootstrap_port: only used by prefill instances of services[{si}].pd.mode sglang-mooncake"
                ));
            }
        }
        return;
    };
    if !matches!(
        pd.decode_policy,
        LbPolicy::LeastToken | LbPolicy::LeastRequest | LbPolicy::RoundRobin
    ) {
        errs.push(format!(
            "services[{si}].pd.decode_policy: expected least-token, least-request or round-robin"
        ));
    }
    let (mut prefill, mut decode) = (0, 0);
    for (ii, i) in s.instances.iter().enumerate() {
        let p = format!("services[{si}].instances[{ii}]");
        match i.role {
            None => errs.push(format!(
                "{p}.role: required in a prefill/decode-disaggregated service (prefill or decode)"
            )),
            Some(InstanceRole::Prefill) => {
                prefill += 1;
                match (pd.mode, i.bootstrap_port) {
                    (PdMode::SglangMooncake, None) => errs.push(format!(
                        "{p}.bootstrap_port: required for a prefill instance in sglang-mooncake mode (the engine's --disaggregation-bootstrap-port; SGLang's default is 8998)"
                    )),
                    (PdMode::SglangMooncake, Some(0)) => {
                        errs.push(format!("{p}.bootstrap_port: must be a port (1-65535)"))
                    }
                    (PdMode::VllmNixl, Some(_)) => errs.push(format!(
                        "{p}.bootstrap_port: not used in vllm-nixl mode (the prefill returns where its KV is in kv_transfer_params)"
                    )),
                    _ => {}
                }
            }
            Some(InstanceRole::Decode) => {
                decode += 1;
                if i.bootstrap_port.is_some() {
                    errs.push(format!(
                        "{p}.bootstrap_port: only prefill instances have a bootstrap port"
                    ));
                }
            }
        }
    }
    if prefill == 0 || decode == 0 {
        errs.push(format!(
            "services[{si}].instances: a prefill/decode-disaggregated service needs at least one prefill and one decode instance ({prefill} prefill, {decode} decode)"
        ));
    }
}

fn validate_scheduler(sc: &SchedulerConfig, p: &str, errs: &mut Vec<String>) {
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

fn validate_policy(ps: &PolicySettings, p: &str, errs: &mut Vec<String>) {
    if ps.plugins.is_empty() {
        errs.push(format!("{p}.plugins: at least one plugin is required"));
    }
    let mut scorers = 0;
    let mut decisions = 0;
    for (i, x) in ps.plugins.iter().enumerate() {
        match x {
            PluginSettings::DecisionService { weight } => {
                decisions += 1;
                if weight.is_some() {
                    errs.push(format!(
                        "{p}.plugins[{i}].weight: decision-service has no weight: its answer restricts the candidates to the target it names (remove the weight)"
                    ));
                }
            }
            other => {
                scorers += 1;
                if let Some(w) = other.weight() {
                    if !(w.is_finite() && w > 0.0) {
                        errs.push(format!(
                            "{p}.plugins[{i}].weight: must be a positive number"
                        ));
                    }
                }
            }
        }
        match x {
            PluginSettings::LeastToken { token_scale, .. }
                if !(token_scale.is_finite() && *token_scale > 0.0) =>
            {
                errs.push(format!(
                    "{p}.plugins[{i}].token_scale: must be a positive number"
                ));
            }
            PluginSettings::PrefixCache { min_hit_ratio, .. }
                if !(0.0..=1.0).contains(min_hit_ratio) =>
            {
                errs.push(format!("{p}.plugins[{i}].min_hit_ratio: must be in [0, 1]"));
            }
            PluginSettings::PredictedTtft {
                temperature,
                tolerance,
                ..
            } => {
                if temperature.is_some_and(|t| t.is_zero()) {
                    errs.push(format!(
                        "{p}.plugins[{i}].temperature: must be longer than 0 (e.g. 100ms)"
                    ));
                }
                if let Some(t) = tolerance {
                    if !(t.is_finite() && *t >= 0.0) {
                        errs.push(format!(
                            "{p}.plugins[{i}].tolerance: must be a number >= 0 (e.g. 0.5)"
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    if decisions > 1 {
        errs.push(format!("{p}.plugins: decision-service is listed twice"));
    }
    if !ps.plugins.is_empty() && scorers == 0 {
        errs.push(format!(
            "{p}.plugins: at least one scoring plugin is required besides decision-service (e.g. least-inflight)"
        ));
    }
    if ps.session_max_entries == 0 {
        errs.push(format!("{p}.session_max_entries: must be at least 1"));
    }
    if ps.session_ttl.is_zero() {
        errs.push(format!("{p}.session_ttl: must be greater than 0"));
    }
}

/// `split:` (see [`SplitSettings`]); errors name the YAML path.
fn validate_split(sp: &SplitSettings, errs: &mut Vec<String>) {
    let locals = sp.proxies.iter().filter(|p| p.local).count();
    if locals != 1 {
        errs.push(format!(
            "split.proxies: needs exactly one entry with local: true (our own services), found {locals}"
        ));
    }
    let mut names = HashSet::new();
    let mut prefixes = HashSet::new();
    for (i, e) in sp.proxies.iter().enumerate() {
        let p = format!("split.proxies[{i}]");
        if e.local {
            for (set, key) in [
                (e.address.is_some(), "address"),
                (!e.model.is_empty(), "model"),
                (e.api_key.is_some(), "api_key"),
                (e.tls.is_some(), "tls"),
            ] {
                if set {
                    errs.push(format!(
                        "{p}.{key}: not for the local entry (it routes to our own services)"
                    ));
                }
            }
            if !e.enabled {
                errs.push(format!(
                    "{p}.enabled: the local entry cannot be disabled (set its weight to 0 instead)"
                ));
            }
        } else {
            match e.name.as_deref() {
                None | Some("") => errs.push(format!("{p}.name: required for an external entry")),
                Some("local") => errs.push(format!("{p}.name: \"local\" names the local entry")),
                Some(n) if http::HeaderValue::from_str(n).is_err() => {
                    errs.push(format!("{p}.name: must be a header value (visible ASCII)"))
                }
                Some(n) => {
                    if !names.insert(n) {
                        errs.push(format!("{p}.name: duplicate entry {n:?}"));
                    }
                }
            }
            match e.address.as_deref() {
                None => errs.push(format!(
                    "{p}.address: required (a base URL such as https://api.example.com/v1)"
                )),
                Some(a) => {
                    if let Err(err) = crate::upstream::parse_url(a) {
                        errs.push(format!("{p}.address: {err}"));
                    }
                }
            }
            if e.model.chars().any(char::is_control) {
                errs.push(format!("{p}.model: must not contain control characters"));
            }
            if let Some(k) = &e.api_key {
                if let Err(err) = k.check() {
                    errs.push(format!("{p}.api_key: {err}"));
                }
            }
            if let Some(t) = &e.tls {
                if let Err(err) = crate::tls::check(t) {
                    errs.push(format!("{p}.tls.{err}"));
                }
            }
        }
        if let Some(px) = &e.prefix {
            let body = px.strip_suffix('*').unwrap_or(px);
            if px.is_empty() || body.contains('*') {
                errs.push(format!(
                    "{p}.prefix: {px:?}: a model prefix with at most a trailing * (\"gpt*\", \"*\")"
                ));
            } else if e.enabled && !prefixes.insert(px.as_str()) {
                errs.push(format!(
                    "{p}.prefix: {px:?} is also another enabled entry's prefix"
                ));
            }
        }
    }
    match sp.strategy {
        SplitStrategy::Weight => {
            let total: u64 = sp
                .proxies
                .iter()
                .filter(|e| e.enabled)
                .map(|e| u64::from(e.weight))
                .sum();
            if total == 0 {
                errs.push(
                    "split.proxies: strategy weight needs an enabled entry with weight > 0".into(),
                );
            }
        }
        SplitStrategy::Prefix => {
            if !sp.proxies.iter().any(|e| e.enabled && e.prefix.is_some()) {
                errs.push(
                    "split.proxies: strategy prefix needs an enabled entry with a prefix".into(),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str =
        "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_yaml(MIN).unwrap();
        assert_eq!(c.listen, vec!["127.0.0.1:8080"]);
        assert_eq!(c.admin_listen, "127.0.0.1:9090");
        assert_eq!(c.max_body_bytes, 32 * 1024 * 1024);
        assert!(c.routing.strict);
        assert_eq!(c.timeouts.connect, Duration::from_secs(3));
    }

    #[test]
    fn unknown_key_names_its_path() {
        let y = "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000, weight: 3}\n";
        let e = Config::from_yaml(y).unwrap_err().to_string();
        assert!(e.starts_with("services[0].instances[0]"), "{e}");
        assert!(e.contains("unknown key `weight`"), "{e}");
    }

    #[test]
    fn semantic_errors_are_all_reported_with_paths() {
        let y = "listen: [nope]\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n  - name: m\n    instances:\n      - {id: a, addr: localhost}\n";
        let e = Config::from_yaml(y).unwrap_err().0;
        let all = e.join("\n");
        assert!(all.contains("listen[0]: invalid socket address"), "{all}");
        assert!(all.contains("services[1].name: duplicate service"), "{all}");
        assert!(
            all.contains("services[1].instances[0].id: duplicate"),
            "{all}"
        );
        assert!(
            all.contains("services[1].instances[0].addr: invalid socket address"),
            "{all}"
        );
    }

    #[test]
    fn instance_ids_must_fit_in_a_header() {
        let y = "services:\n  - name: m\n    instances:\n      - {id: \"a\\nb\", addr: 127.0.0.1:8000}\n";
        let all = Config::from_yaml(y).unwrap_err().0.join("\n");
        assert!(
            all.contains("services[0].instances[0].id: \"a\\nb\" cannot be sent in the x-tokengate-instance header"),
            "{all}"
        );
    }

    #[test]
    fn default_model_must_exist_and_needs_non_strict() {
        let y = format!("routing: {{strict: false, default_model: x}}\n{MIN}");
        let e = Config::from_yaml(&y).unwrap_err().to_string();
        assert!(
            e.contains("routing.default_model: \"x\" is not the name"),
            "{e}"
        );
        let y = format!("routing: {{strict: false, default_model: m}}\n{MIN}");
        assert!(Config::from_yaml(&y).is_ok());
    }

    #[test]
    fn bad_duration_names_its_path() {
        let y = format!("timeouts: {{connect: fast}}\n{MIN}");
        let e = Config::from_yaml(&y).unwrap_err().to_string();
        assert!(e.starts_with("timeouts.connect:"), "{e}");
    }

    #[test]
    fn retry_statuses_and_client_body_timeout() {
        let c = Config::from_yaml(MIN).unwrap();
        assert_eq!(c.passive_health.retry_on_status, vec![503, 429]);
        assert_eq!(c.timeouts.client_body, Duration::from_secs(60));
        let y = format!(
            "passive_health: {{retry_on_status: []}}\ntimeouts: {{client_body: 5s}}\n{MIN}"
        );
        let c = Config::from_yaml(&y).unwrap();
        assert!(c.passive_health.retry_on_status.is_empty());
        assert_eq!(c.timeouts.client_body, Duration::from_secs(5));
        let y = format!("passive_health: {{retry_on_status: [502, 200]}}\n{MIN}");
        let e = Config::from_yaml(&y).unwrap_err().to_string();
        assert!(
            e.contains("passive_health.retry_on_status[1]: 200 cannot be retried"),
            "{e}"
        );
        let y = format!("timeouts: {{client_body: 0s}}\n{MIN}");
        let e = Config::from_yaml(&y).unwrap_err().to_string();
        assert!(
            e.contains("timeouts.client_body: must be greater than 0"),
            "{e}"
        );
    }

    /// Every enum-like key is a serde enum: a wrong name is an error at its YAML path that
    /// lists the accepted names.
    #[test]
    fn enum_keys_name_their_path_and_the_accepted_values() {
        let cases = [
            (
                "services:\n  - name: m\n    load_balancing: random\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
                "services[0].load_balancing: `random` is not one of `least-token`, `least-request`, `round-robin`, `predicted-ttft`",
            ),
            (
                "services:\n  - name: m\n    scheduler: {mode: layered, affinity: {mode: sticky}}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
                "`sticky` is not one of `soft`, `strict`",
            ),
            (
                "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [{kind: fastest}]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
                "`fastest` is not one of `session-affinity`, `least-inflight`, `least-token`, `predicted-ttft`, `least-cached`, `prefix-cache`, `decision-service`",
            ),
            (
                "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [{kind: least-inflight, token_scale: 5}]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
                "unknown key `token_scale`",
            ),
            (
                "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [{kind: least-inflight}], session_keys: [cookie:x]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
                "\"cookie:x\" is not header:NAME, body:prompt_cache_key, body:user or body:metadata.user_id",
            ),
            (
                "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\nroutes:\n  - {name: r, route_by: random, targets: [{service: m}]}\n",
                "routes[0].route_by: `random` is not one of `round-robin`, `weight`, `policy`",
            ),
        ];
        for (y, want) in cases {
            let e = Config::from_yaml(y).unwrap_err().to_string();
            assert!(e.contains(want), "{y}\n=> {e}");
        }
    }

    #[test]
    fn least_cached_and_the_ttft_temperature_are_parsed_and_checked() {
        let y = "services:\n  - name: m\n    scheduler: {mode: layered, least_cached: {enabled: true, ttft_tolerance: 1.0, ttft_slack: 20ms}}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n  - name: p\n    scheduler: {mode: policy, plugins: [{kind: predicted-ttft, temperature: 250ms, tolerance: 0.5, slack: 50ms}, {kind: least-cached, weight: 0.25}]}\n    instances:\n      - {id: b, addr: 127.0.0.1:8001}\n";
        let c = Config::from_yaml(y).unwrap();
        let Some(SchedulerConfig::Layered { least_cached, .. }) = &c.services[0].scheduler else {
            panic!("layered expected")
        };
        assert!(least_cached.enabled);
        assert_eq!(least_cached.ttft_tolerance, Some(1.0));
        assert_eq!(least_cached.ttft_slack, Some(Duration::from_millis(20)));
        let Some(SchedulerConfig::Policy(ps)) = &c.services[1].scheduler else {
            panic!("policy expected")
        };
        assert!(matches!(
            ps.plugins[0],
            PluginSettings::PredictedTtft { temperature: Some(t), tolerance: Some(tol), slack: Some(sl), .. }
                if t == Duration::from_millis(250) && tol == 0.5 && sl == Duration::from_millis(50)
        ));
        assert_eq!(ps.plugins[1].kind(), "least-cached");
        assert_eq!(ps.plugins[1].weight(), Some(0.25));
        // On unless turned off.
        for (with, on) in [
            ("prefix: {}", true),
            ("least_cached: {enabled: false}", false),
        ] {
            let plain = Config::from_yaml(&y.replace(
                "least_cached: {enabled: true, ttft_tolerance: 1.0, ttft_slack: 20ms}",
                with,
            ))
            .unwrap();
            let Some(SchedulerConfig::Layered { least_cached, .. }) = &plain.services[0].scheduler
            else {
                panic!("layered expected")
            };
            assert_eq!(least_cached.enabled, on, "{with}");
        }
        let bad = y
            .replace("ttft_tolerance: 1.0", "ttft_tolerance: -1")
            .replace("temperature: 250ms", "temperature: 0s")
            .replace("tolerance: 0.5", "tolerance: -0.5");
        let e = Config::from_yaml(&bad).unwrap_err().to_string();
        assert!(
            e.contains("services[0].scheduler.least_cached.ttft_tolerance: must be >= 0"),
            "{e}"
        );
        assert!(
            e.contains("services[1].scheduler.plugins[0].temperature: must be longer than 0"),
            "{e}"
        );
        assert!(
            e.contains("services[1].scheduler.plugins[0].tolerance: must be a number >= 0"),
            "{e}"
        );
    }

    #[test]
    fn an_instance_cache_size_is_at_least_one_prefix_block() {
        let y = "prefix_index: {block_size: 16}\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8001, cache_tokens: 262144}\n";
        let c = Config::from_yaml(y).unwrap();
        assert_eq!(c.services[0].instances[0].cache_tokens, Some(262_144));
        let e = Config::from_yaml(&y.replace("262144", "8"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("services[0].instances[0].cache_tokens: 8 is less than one prefix block"),
            "{e}"
        );
    }

    #[test]
    fn the_ttft_filter_and_unbound_affinity_are_parsed_and_checked() {
        let y = "services:\n  - name: p\n    scheduler: {mode: policy, plugins: [{kind: predicted-ttft, filter: true, tolerance: 0.25, slack: 25ms}, {kind: session-affinity, weight: 2, unbound: abstain}]}\n    instances:\n      - {id: b, addr: 127.0.0.1:8001}\n";
        let c = Config::from_yaml(y).unwrap();
        let Some(SchedulerConfig::Policy(ps)) = &c.services[0].scheduler else {
            panic!("policy expected")
        };
        assert!(matches!(
            ps.plugins[0],
            PluginSettings::PredictedTtft { filter: true, .. }
        ));
        assert!(matches!(
            ps.plugins[1],
            PluginSettings::SessionAffinity {
                unbound: UnboundSessions::Abstain,
                weight: Some(2.0)
            }
        ));
        // Defaults: not a filter, rendezvous for unbound sessions.
        let plain = Config::from_yaml(
            &y.replace("filter: true, ", "")
                .replace(", unbound: abstain", ""),
        )
        .unwrap();
        let Some(SchedulerConfig::Policy(ps)) = &plain.services[0].scheduler else {
            panic!("policy expected")
        };
        assert!(matches!(
            ps.plugins[0],
            PluginSettings::PredictedTtft { filter: false, .. }
        ));
        assert!(matches!(
            ps.plugins[1],
            PluginSettings::SessionAffinity {
                unbound: UnboundSessions::Rendezvous,
                ..
            }
        ));
        let e = Config::from_yaml(&y.replace("unbound: abstain", "unbound: hash"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`hash` is not one of `rendezvous`, `abstain`"),
            "{e}"
        );
    }

    #[test]
    fn plugin_parameters_are_typed_and_checked() {
        let y = "services:\n  - name: m\n    scheduler:\n      mode: policy\n      plugins:\n        - {kind: least-token, token_scale: 500, weight: 2}\n        - {kind: prefix-cache, min_hit_ratio: 0.2}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";
        let c = Config::from_yaml(y).unwrap();
        let Some(SchedulerConfig::Policy(ps)) = &c.services[0].scheduler else {
            panic!("policy expected")
        };
        assert!(matches!(
            ps.plugins[0],
            PluginSettings::LeastToken { weight: Some(w), token_scale } if w == 2.0 && token_scale == 500.0
        ));
        assert!(matches!(
            ps.plugins[1],
            PluginSettings::PrefixCache { weight: None, min_hit_ratio, max_waiting: None } if min_hit_ratio == 0.2
        ));
        assert_eq!(ps.session_max_entries, 100_000);
        let bad = y
            .replace("token_scale: 500", "token_scale: 0")
            .replace("0.2", "1.5");
        let e = Config::from_yaml(&bad).unwrap_err().to_string();
        assert!(
            e.contains("services[0].scheduler.plugins[0].token_scale: must be a positive number"),
            "{e}"
        );
        assert!(
            e.contains("services[0].scheduler.plugins[1].min_hit_ratio: must be in [0, 1]"),
            "{e}"
        );
    }

    #[test]
    fn decision_service_is_a_filter_with_a_model_per_route() {
        let base = "services:\n  - name: a\n    instances:\n      - {id: a1, addr: 127.0.0.1:8000}\n  - name: b\n    instances:\n      - {id: b1, addr: 127.0.0.1:8001}\nproviders:\n  - {name: p, base_url: \"http://127.0.0.1:1/v1\"}\n";
        let route = |plugins: &str, decision: &str| {
            format!("{base}routes:\n  - name: r\n    targets: [{{service: a}}, {{service: b}}]\n    policy: {{plugins: [{plugins}]}}\n{decision}")
        };
        // A provider without a model needs the route to name one.
        let e = Config::from_yaml(&route(
            "{kind: decision-service}, {kind: least-inflight}",
            "    decision: {provider: p}\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("routes[0].decision.model: required"), "{e}");
        let c = Config::from_yaml(&route(
            "{kind: decision-service}, {kind: least-inflight}",
            "    decision: {provider: p, model: judge-1}\n",
        ))
        .unwrap();
        assert!(c.routes[0].uses_decision());
        assert!(c.warnings().is_empty());
        // A weight on the filter is explained, not ignored.
        let e = Config::from_yaml(&route(
            "{kind: decision-service, weight: 10}, {kind: least-inflight}",
            "    decision: {provider: p, model: m}\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("routes[0].policy.plugins[0].weight: decision-service has no weight"),
            "{e}"
        );
        // The filter alone cannot pick an instance.
        let e = Config::from_yaml(&route(
            "{kind: decision-service}",
            "    decision: {provider: p, model: m}\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("at least one scoring plugin"), "{e}");
        // A decision block nothing uses: valid, with a warning.
        let c = Config::from_yaml(&route(
            "{kind: least-inflight}",
            "    decision: {provider: p, model: m}\n",
        ))
        .unwrap();
        assert!(!c.routes[0].uses_decision());
        assert!(
            c.warnings()[0].contains("the decision model is never asked"),
            "{:?}",
            c.warnings()
        );
    }

    #[test]
    fn mirror_settings_are_checked_with_paths() {
        let base =
            "services:\n  - name: m\n    instances:\n      - {id: a, addr: \"127.0.0.1:1\"}\n";
        let c = Config::from_yaml(&format!(
            "{base}mirror: {{target: \"http://127.0.0.1:19400\", ratio: 10, auth_token: sk-x, log: true}}\n"
        ))
        .unwrap();
        let m = c.mirror.unwrap();
        assert_eq!(m.ratio, 10.0);
        assert_eq!(m.timeout_ms, 5000);
        assert!(m.target_model.is_empty());
        assert!(m.log);
        let e = Config::from_yaml(&format!(
            "{base}mirror: {{target: \"ftp://x\", ratio: 101, timeout_ms: 0, auth_token: \"a b\"}}\n"
        ))
        .unwrap_err()
        .to_string();
        for want in [
            "mirror.target: \"ftp://x\" must start with http:// or https://",
            "mirror.ratio: 101 is not a percentage",
            "mirror.timeout_ms: must be greater than 0",
            "mirror.auth_token: must be non-empty without whitespace",
        ] {
            assert!(e.contains(want), "{want} not in {e}");
        }
        let e = Config::from_yaml(&format!(
            "{base}mirror: {{target: \"http://h\", rate: 5}}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("mirror.rate: unknown key `rate`"), "{e}");
        let e = Config::from_yaml(&format!("{base}mirror: {{ratio: 5}}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("mirror.target: `target` is required"), "{e}");
        let c = Config::from_yaml(&format!(
            "{base}mirror: {{target: \"https://shadow.example.com/shadow\", ratio: 0.001}}\n"
        ))
        .unwrap();
        assert!(
            c.warnings()[0].contains("mirror.ratio"),
            "{:?}",
            c.warnings()
        );
    }
}
