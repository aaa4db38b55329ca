//! What the decision service is asked about: the provider (a chat model) and the spec (the
//! instructions and the targets).

use std::time::Duration;

/// Timeout of one decision call when the config names none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// A registered OpenAI-compatible chat model used as a decision service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Provider {
    pub name: String,
    /// API base including the version, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// Model name sent in the request, e.g. `jev-latest`.
    pub model: String,
}

impl Provider {
    /// `{base_url}/chat/completions`.
    pub fn chat_url(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}

/// One target the decision model may name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetCriteria {
    /// The name the model answers with (a route target: model or service name).
    pub name: String,
    /// When the target fits; `None` → [`generated_criteria`](super::generated_criteria).
    pub criteria: Option<String>,
}

/// What to ask: the instructions and the targets, in route order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionSpec {
    pub instructions: String,
    pub targets: Vec<TargetCriteria>,
    /// Bound of the whole call.
    pub timeout: Duration,
}

impl DecisionSpec {
    /// A spec with the default timeout.
    pub fn new(instructions: impl Into<String>, targets: Vec<TargetCriteria>) -> Self {
        DecisionSpec {
            instructions: instructions.into(),
            targets,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}
