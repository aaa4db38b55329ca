//! Policy scheduling (`scheduler: {mode: policy}` of a service, `policy:` of a route): the
//! plugins, their weights and where the session key comes from.

use serde::Deserialize;
use std::time::Duration;

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

fn d_session_chain() -> Vec<KeySource> {
    vec![
        KeySource::Header("session-id".into()),
        KeySource::Header("x-client-request-id".into()),
        KeySource::PromptCacheKey,
    ]
}
pub(super) fn d_session_ttl() -> Duration {
    Duration::from_secs(1800)
}
pub(super) fn d_max_entries() -> usize {
    100_000
}
fn d_token_scale() -> f64 {
    1000.0
}
fn d_min_hit() -> f64 {
    0.5
}

pub(super) fn validate_policy(ps: &PolicySettings, p: &str, errs: &mut Vec<String>) {
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
