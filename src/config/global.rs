//! `global:`: member gateways in other regions that take the requests this one cannot.

use serde::{Deserialize, Serialize};
use std::collections::HashSet;

pub use crate::upstream::EndpointUrl;

/// Global scheduling: when local instances cannot take a request (throttling would reject
/// it, the queue is full, no instance is available), it is forwarded to a member gateway.
#[derive(Debug, Clone, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    pub name: String,
    /// Its proxy listener, e.g. `http://gw.eu-west.internal:8080` (a name or an IP; https
    /// with certificate checks).
    pub url: EndpointUrl,
    /// The API key it accepts from this gateway (sent as `Authorization: Bearer`; never
    /// logged).
    #[serde(default, serialize_with = "super::secret::masked")]
    pub token: Option<String>,
}

impl GlobalSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let mut members = HashSet::new();
        if http::HeaderValue::from_str(&self.name).is_err() || self.name.is_empty() {
            errs.push("global.name: must be a non-empty header value (visible ASCII)".into());
        }
        for (i, m) in self.members.iter().enumerate() {
            let p = format!("global.members[{i}]");
            if m.name.is_empty() || http::HeaderValue::from_str(&m.name).is_err() {
                errs.push(format!(
                    "{p}.name: must be a non-empty header value (visible ASCII)"
                ));
            } else if !members.insert(m.name.as_str()) {
                errs.push(format!("{p}.name: duplicate member {:?}", m.name));
            }
            if let Err(e) = m.url.parts() {
                errs.push(format!("{p}.url: {e}"));
            }
            if let Some(t) = &m.token {
                if t.is_empty() || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    errs.push(format!("{p}.token: must be non-empty without whitespace"));
                }
            }
        }
    }
}
