//! Decision service client: asks an OpenAI-compatible chat model (a registered [`Provider`])
//! which of a route's targets fits a request, and turns its answer into a [`DecisionOutcome`].
//!
//! **The question.** One non-streaming `POST {base_url}/chat/completions` with `model` =
//! the provider's model, `max_tokens` = [`MAX_ANSWER_TOKENS`], `temperature` 0,
//! `Authorization: Bearer <api_key>` when a key is set, and two messages
//! ([`system_prompt`], [`request_body`]):
//!
//! ```text
//! system: <instructions>
//!
//!         Targets:
//!         1. qwen3-0.6b: short factual questions, greetings, small talk
//!         2. qwen3-32b: reasoning, math, proofs, code
//!
//!         Answer with exactly one target name from the list and nothing else.
//! user:   <the request's last user message, at most MAX_REQUEST_CHARS characters>
//! ```
//!
//! The system message depends only on the spec, so a decision model with prefix caching
//! reuses it across requests. Newlines inside names and criteria are flattened to spaces so
//! each target stays one line. A target without criteria gets generated ones
//! ([`generated_criteria`]): "the model `name`", plus its size when the name carries one
//! (`32b`, `0.6b`, `135m`) and, when at least two sizes differ, a hint that the smallest is
//! for short, simple requests and the largest for reasoning, math, proofs and code.
//!
//! **The answer** (`choices[0].message.content`, [`parse_answer`]): a leading
//! `<think>…</think>` block is dropped; then, trimmed of whitespace, quotes, backticks and
//! punctuation, a case-insensitive exact match of a target name wins; else a bare number
//! `1..=n` names the n-th target of the list; else the answer must contain exactly one target
//! name as a whole word (not touching letters, digits or `_`). Longer names are matched
//! first and claim their text, so `qwen3-32b` in the answer does not also count as a target
//! named `qwen3`; two different names left → ambiguous. Anything else abstains.
//!
//! **Outcomes.** The whole call (connect, send, read) is bounded by the spec's `timeout`
//! (default [`DEFAULT_TIMEOUT`]) → [`AbstainReason::Timeout`]; transport errors, a non-200
//! status, a body that is not a chat completion, or one larger than [`MAX_RESPONSE_BYTES`] →
//! [`AbstainReason::Error`]; an answer naming no single target →
//! [`AbstainReason::NoTarget`]. The decision never fails a request: on abstention the route
//! keeps all its targets. [`DecisionClient::decide`] also returns the call's latency.

use std::fmt;
use std::time::{Duration, Instant};

mod answer;
mod prompt;
mod spec;
#[cfg(test)]
mod tests;

pub use answer::{answer_text, parse_answer};
pub use prompt::{
    generated_criteria, request_body, request_text, size_from_name, system_prompt, truncate_chars,
    ANSWER_RULE, MAX_ANSWER_TOKENS, MAX_REQUEST_CHARS,
};
pub use spec::{DecisionSpec, Provider, TargetCriteria, DEFAULT_TIMEOUT};

/// Larger decision responses are errors (a target name is a few bytes).
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;
/// At most this many characters of a bad answer are kept in [`AbstainReason::NoTarget`].
const MAX_KEPT_ANSWER_CHARS: usize = 200;

/// Why the decision service gave no target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbstainReason {
    /// The call did not finish within the spec's timeout.
    Timeout,
    /// Transport error, non-200 status, or a body that is not a chat completion.
    Error(String),
    /// The answer (kept, shortened) names no single target.
    NoTarget(String),
}

/// The decision: an index into [`DecisionSpec::targets`], or an abstention.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecisionOutcome {
    Target(usize),
    Abstain(AbstainReason),
}

impl DecisionOutcome {
    /// Metric label: `target`, `timeout`, `error` or `no_target`.
    pub fn label(&self) -> &'static str {
        match self {
            DecisionOutcome::Target(_) => "target",
            DecisionOutcome::Abstain(AbstainReason::Timeout) => "timeout",
            DecisionOutcome::Abstain(AbstainReason::Error(_)) => "error",
            DecisionOutcome::Abstain(AbstainReason::NoTarget(_)) => "no_target",
        }
    }

    /// The chosen target's index, if any.
    pub fn target(&self) -> Option<usize> {
        match self {
            DecisionOutcome::Target(i) => Some(*i),
            DecisionOutcome::Abstain(_) => None,
        }
    }
}

impl fmt::Display for DecisionOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecisionOutcome::Target(i) => write!(f, "target #{i}"),
            DecisionOutcome::Abstain(AbstainReason::Timeout) => f.write_str("abstain: timeout"),
            DecisionOutcome::Abstain(AbstainReason::Error(e)) => write!(f, "abstain: error: {e}"),
            DecisionOutcome::Abstain(AbstainReason::NoTarget(a)) => {
                write!(f, "abstain: no target in answer {a:?}")
            }
        }
    }
}

/// The decision service client: one per gateway; its HTTP connections are pooled.
#[derive(Clone, Debug)]
pub struct DecisionClient {
    http: reqwest::Client,
}

impl Default for DecisionClient {
    fn default() -> Self {
        Self::new()
    }
}

impl DecisionClient {
    pub fn new() -> Self {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .build()
            .unwrap_or_default();
        DecisionClient { http }
    }

    /// Asks `p` which of `spec.targets` fits `user_request` (the request's text, e.g. from
    /// [`request_text`]; cut to [`MAX_REQUEST_CHARS`] here as well). Never fails: errors,
    /// timeouts and unusable answers are abstentions. Returns the outcome and the call's
    /// latency (up to the timeout, when it fires).
    pub async fn decide(
        &self,
        p: &Provider,
        spec: &DecisionSpec,
        user_request: &str,
    ) -> (DecisionOutcome, Duration) {
        let start = Instant::now();
        let outcome = if spec.targets.is_empty() {
            DecisionOutcome::Abstain(AbstainReason::Error("no targets to choose from".into()))
        } else {
            match tokio::time::timeout(spec.timeout, self.ask(p, spec, user_request)).await {
                Err(_) => DecisionOutcome::Abstain(AbstainReason::Timeout),
                Ok(Err(e)) => DecisionOutcome::Abstain(AbstainReason::Error(e)),
                Ok(Ok(answer)) => match parse_answer(&answer, &spec.targets) {
                    Some(i) => DecisionOutcome::Target(i),
                    None => DecisionOutcome::Abstain(AbstainReason::NoTarget(
                        truncate_chars(&answer, MAX_KEPT_ANSWER_CHARS).to_string(),
                    )),
                },
            }
        };
        (outcome, start.elapsed())
    }

    /// One call; the answer's text, or what went wrong.
    async fn ask(&self, p: &Provider, spec: &DecisionSpec, user: &str) -> Result<String, String> {
        let mut req = self
            .http
            .post(p.chat_url())
            .json(&request_body(p, spec, user));
        if let Some(key) = &p.api_key {
            req = req.bearer_auth(key);
        }
        let mut resp = req
            .send()
            .await
            .map_err(|e| format!("provider {}: {e}", p.name))?;
        let status = resp.status();
        let mut body = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| format!("provider {}: reading the response: {e}", p.name))?
        {
            if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                return Err(format!(
                    "provider {}: response larger than {MAX_RESPONSE_BYTES} bytes",
                    p.name
                ));
            }
            body.extend_from_slice(&chunk);
        }
        if status != reqwest::StatusCode::OK {
            let text = String::from_utf8_lossy(&body);
            return Err(format!(
                "provider {}: HTTP {}: {}",
                p.name,
                status.as_u16(),
                truncate_chars(text.trim(), MAX_KEPT_ANSWER_CHARS)
            ));
        }
        answer_text(&body).map_err(|e| format!("provider {}: {e}", p.name))
    }
}
