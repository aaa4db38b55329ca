//! `providers:` and a route's `decision:`: the chat models the decision service asks.

use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub name: String,
    /// Base URL up to `/v1`, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    #[serde(default, serialize_with = "super::secret::masked")]
    pub api_key: Option<String>,
    /// The model routes ask by default, e.g. `jev-latest` (a route's `decision.model`
    /// overrides it).
    #[serde(default)]
    pub model: Option<String>,
}

fn d_instructions() -> String {
    "You route requests to the model that fits them best: the smallest model that can answer well."
        .into()
}
fn d_decision_timeout() -> Duration {
    Duration::from_secs(2)
}

/// Every provider; returns their names.
pub(super) fn validate_providers<'a>(
    providers: &'a [ProviderConfig],
    errs: &mut Vec<String>,
) -> HashSet<&'a str> {
    let mut pnames = HashSet::new();
    for (pi, p) in providers.iter().enumerate() {
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
    pnames
}

impl DecisionSettings {
    /// `routes[ri].decision` (`p` is `routes[ri]`) against the providers.
    pub(super) fn validate(
        &self,
        p: &str,
        providers: &[ProviderConfig],
        pnames: &HashSet<&str>,
        errs: &mut Vec<String>,
    ) {
        let d = self;
        if !pnames.contains(d.provider.as_str()) {
            errs.push(format!(
                "{p}.decision.provider: {:?} is not the name of a provider",
                d.provider
            ));
        }
        if d.timeout.is_zero() {
            errs.push(format!("{p}.decision.timeout: must be greater than 0"));
        }
        let provider_model = providers
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
