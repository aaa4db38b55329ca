//! `split:`: the split proxy (external APIs next to our own services).

use super::secret::Secret;
use crate::tls::TlsSettings;
use crate::upstream::EndpointUrl;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Split proxy (`split:`). See [`crate::split`].
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SplitSettings {
    #[serde(default)]
    pub strategy: SplitStrategy,
    /// Exactly one `local: true` entry (our own services) and any number of external APIs.
    pub proxies: Vec<SplitProxy>,
}

/// How a request's entry is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitFailover {
    /// When it fails before the first response byte the request moves on to the next
    /// participating entry, and it takes requests other entries failed.
    Participate,
    /// Its failures are answered as they are; it takes no other entry's requests.
    None,
}

/// One entry of `split.proxies`.
#[derive(Debug, Clone, Deserialize, Serialize)]
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
    pub address: Option<EndpointUrl>,
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

impl SplitSettings {
    /// Errors name the YAML path.
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let sp = self;
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
                    None | Some("") => {
                        errs.push(format!("{p}.name: required for an external entry"))
                    }
                    Some("local") => {
                        errs.push(format!("{p}.name: \"local\" names the local entry"))
                    }
                    Some(n) if http::HeaderValue::from_str(n).is_err() => {
                        errs.push(format!("{p}.name: must be a header value (visible ASCII)"))
                    }
                    Some(n) => {
                        if !names.insert(n) {
                            errs.push(format!("{p}.name: duplicate entry {n:?}"));
                        }
                    }
                }
                match e.address.as_ref() {
                    None => errs.push(format!(
                        "{p}.address: required (a base URL such as https://api.example.com/v1)"
                    )),
                    Some(a) => {
                        if let Err(err) = a.parts() {
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
                        "split.proxies: strategy weight needs an enabled entry with weight > 0"
                            .into(),
                    );
                }
            }
            SplitStrategy::Prefix => {
                if !sp.proxies.iter().any(|e| e.enabled && e.prefix.is_some()) {
                    errs.push(
                        "split.proxies: strategy prefix needs an enabled entry with a prefix"
                            .into(),
                    );
                }
            }
        }
    }
}

fn d_true() -> bool {
    true
}
