//! `tenants:` named groups of client keys, each with the models it may call, a priority
//! class and rate limits. The global `api_keys` stay one implicit tenant ([`IMPLICIT`]).
//!
//! Keys come from `keys`, `keys_file` (one per line, `#` comments) or `keys_env` (an
//! environment variable holding keys separated by commas or whitespace); the last two are
//! read into `keys` by [`crate::config_source`], so every key is checked and printed
//! (masked) the same way.

use super::secret;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The tenant of the global `api_keys` (every model, no limits).
pub const IMPLICIT: &str = "default";

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The name in metrics, the access log and errors (never a key).
    pub name: String,
    /// The keys that identify the tenant (`Authorization: Bearer …` or `x-api-key`).
    #[serde(default, serialize_with = "secret::masked_all")]
    pub keys: Vec<String>,
    /// The models it may call: names, or prefixes ending in `*` (`qwen3-*`; `*`: every
    /// model). A name matches the model the client sends or the service / route it
    /// resolves to.
    #[serde(default = "every_model")]
    pub models: Vec<String>,
    /// Its class: `interactive`, `default` or `batch`.
    #[serde(default)]
    pub priority: Priority,
    /// Its rate limits (absent: none).
    #[serde(default)]
    pub limits: TenantLimits,
}

fn every_model() -> Vec<String> {
    vec!["*".into()]
}

/// A tenant's priority class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Interactive,
    #[default]
    Default,
    Batch,
}

/// A tenant's limits; each one absent is no limit. The per-minute limits are token
/// buckets that refill continuously (a full minute's worth at most).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Prompt tokens (the gateway's estimate reserved at admission, the engine's count
    /// charged at completion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens_per_minute: Option<u64>,
    /// Output tokens (`max_tokens`, or 256 without it, reserved at admission; what the
    /// answer really used charged at completion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_minute: Option<u64>,
    /// Requests in flight at once (waiting in a throttling queue included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u64>,
}

/// Whether a tenant name is usable as a metric label and a log field.
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A tenant's model that names nothing served: a typo, most likely (the split proxy's
/// external entries take any name, so then nothing is said).
pub(super) fn warnings(
    tenants: &[TenantConfig],
    services: &[super::services::ServiceConfig],
    routes: &[super::routes::RouteConfig],
    w: &mut Vec<String>,
) {
    let names: Vec<&str> = services
        .iter()
        .flat_map(|s| std::iter::once(&s.name).chain(&s.aliases))
        .chain(
            routes
                .iter()
                .flat_map(|r| std::iter::once(&r.name).chain(&r.aliases)),
        )
        .map(String::as_str)
        .collect();
    for (ti, t) in tenants.iter().enumerate() {
        for (mi, m) in t.models.iter().enumerate() {
            let hits = match m.strip_suffix('*') {
                Some(p) => names.iter().any(|n| n.starts_with(p)),
                None => names.contains(&m.as_str()),
            };
            if !hits {
                w.push(format!(
                    "tenants[{ti}].models[{mi}]: {m:?} matches no service, route or alias"
                ));
            }
        }
    }
}

/// Checks `tenants:` (and that no key is given twice, here or in `api_keys`).
pub(super) fn validate(tenants: &[TenantConfig], api_keys: &[String], errs: &mut Vec<String>) {
    let mut names: HashMap<&str, usize> = HashMap::new();
    // Where each key was first seen (a path, never the key).
    let mut seen: HashMap<&str, String> = HashMap::new();
    for (i, k) in api_keys.iter().enumerate() {
        seen.entry(k.as_str())
            .or_insert_with(|| format!("api_keys[{i}]"));
    }
    for (ti, t) in tenants.iter().enumerate() {
        let at = format!("tenants[{ti}]");
        if !valid_name(&t.name) {
            errs.push(format!(
                "{at}.name: {:?} must be 1 to 64 letters, digits, `-`, `_` or `.`",
                t.name
            ));
        } else if let Some(first) = names.insert(t.name.as_str(), ti) {
            errs.push(format!(
                "{at}.name: {:?} is already the name of tenants[{first}]",
                t.name
            ));
        } else if t.name == IMPLICIT && !api_keys.is_empty() {
            errs.push(format!(
                "{at}.name: {IMPLICIT:?} is the tenant of the global api_keys; choose another name"
            ));
        }
        if t.keys.is_empty() {
            errs.push(format!(
                "{at}.keys: at least one key is required (keys, keys_file or keys_env)"
            ));
        }
        for (ki, k) in t.keys.iter().enumerate() {
            if k.trim().is_empty() || k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                errs.push(format!(
                    "{at}.keys[{ki}]: must be non-empty and contain no whitespace"
                ));
                continue;
            }
            // A printed config masks every key the same way; the mask is no duplicate.
            if k == secret::MASK {
                continue;
            }
            if let Some(first) = seen.get(k.as_str()) {
                errs.push(format!(
                    "{at}.keys[{ki}]: the same key as {first} (a key names one tenant)"
                ));
            } else {
                seen.insert(k.as_str(), format!("{at}.keys[{ki}]"));
            }
        }
        if t.models.is_empty() {
            errs.push(format!(
                "{at}.models: at least one model name or prefix* is required (\"*\": every model)"
            ));
        }
        for (mi, m) in t.models.iter().enumerate() {
            let star = m.find('*');
            if m.is_empty() || star.is_some_and(|s| s + 1 != m.len()) {
                errs.push(format!(
                    "{at}.models[{mi}]: {m:?} must be a model name or a prefix ending in `*`"
                ));
            }
        }
        let l = &t.limits;
        for (key, v) in [
            ("requests_per_minute", l.requests_per_minute),
            ("input_tokens_per_minute", l.input_tokens_per_minute),
            ("output_tokens_per_minute", l.output_tokens_per_minute),
            ("concurrency", l.concurrency),
        ] {
            if v == Some(0) {
                errs.push(format!(
                    "{at}.limits.{key}: must be at least 1 (leave it out for no limit)"
                ));
            }
        }
    }
}
