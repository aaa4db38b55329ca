//! `mirror:`: traffic mirroring.

use crate::upstream::EndpointUrl;
use serde::{Deserialize, Serialize};

/// Traffic mirroring (`mirror:`): a share of planned requests is copied, asynchronously, to
/// another OpenAI-compatible endpoint; its answers are measured and thrown away. See
/// [`crate::mirror`].
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorSettings {
    /// Base URL (`http://` or `https://`); the client's path is appended.
    pub target: EndpointUrl,
    /// Blank: the mirrored body keeps its `model`; else the body's `model` is replaced.
    #[serde(default)]
    pub target_model: String,
    /// Percent of requests mirrored, 0–100 (fractions allowed, down to 0.01).
    #[serde(default = "d_mirror_ratio")]
    pub ratio: f64,
    /// Sent to the target as `Authorization: Bearer` (never logged, never in `/admin`).
    #[serde(default, serialize_with = "super::secret::masked")]
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

impl MirrorSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let m = self;
        if let Err(e) = m.target.parts() {
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

    pub(super) fn warnings(&self, w: &mut Vec<String>) {
        let m = self;
        if m.ratio > 0.0 && m.ratio < 0.01 {
            w.push(format!(
            "mirror.ratio: {} is below the sampling resolution (0.01 percent); nothing is mirrored",
            m.ratio
        ));
        }
    }
}
