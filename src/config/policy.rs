//! Policy scheduling (`scheduler: {mode: policy}` of a service, `policy:` of a route): the
//! plugins, their weights and where the session key comes from.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The plugins' parameters live with their logic in `tokengate-plugins` (one file each).
pub use tokengate_plugins::{PluginSettings, UnboundSessions};

#[derive(Debug, Clone, Deserialize, Serialize)]
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

impl Serialize for KeySource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KeySource::Header(h) => s.serialize_str(&format!("header:{h}")),
            KeySource::PromptCacheKey => s.serialize_str("body:prompt_cache_key"),
            KeySource::User => s.serialize_str("body:user"),
            KeySource::MetadataUserId => s.serialize_str("body:metadata.user_id"),
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
pub(super) fn validate_policy(ps: &PolicySettings, p: &str, errs: &mut Vec<String>) {
    if ps.plugins.is_empty() {
        errs.push(format!("{p}.plugins: at least one plugin is required"));
    }
    let mut scorers = 0;
    let mut decisions = 0;
    for (i, x) in ps.plugins.iter().enumerate() {
        let px = format!("{p}.plugins[{i}]");
        if let PluginSettings::DecisionService(_) = x {
            decisions += 1;
        } else {
            scorers += 1;
            if let Some(w) = x.weight() {
                if !(w.is_finite() && w > 0.0) {
                    errs.push(format!("{px}.weight: must be a positive number"));
                }
            }
        }
        x.check(&px, errs);
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
