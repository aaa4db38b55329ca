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

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Timeout of one decision call when the config names none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// `max_tokens` of the question: a target name is a few tokens.
pub const MAX_ANSWER_TOKENS: u64 = 16;
/// At most this many characters of the user's request are sent (the head of the text).
pub const MAX_REQUEST_CHARS: usize = 4000;
/// Larger decision responses are errors (a target name is a few bytes).
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;
/// The last line of the system message.
pub const ANSWER_RULE: &str = "Answer with exactly one target name from the list and nothing else.";
/// At most this many characters of a bad answer are kept in [`AbstainReason::NoTarget`].
const MAX_KEPT_ANSWER_CHARS: usize = 200;

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
    /// When the target fits; `None` → [`generated_criteria`].
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

/// `choices[0].message.content` of a chat completion body (a `null` content is "").
pub fn answer_text(body: &[u8]) -> Result<String, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("response is not JSON: {e}"))?;
    let Some(msg) = v.pointer("/choices/0/message") else {
        return Err("response has no choices[0].message".into());
    };
    match msg.get("content") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Null) | None => Ok(String::new()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect()),
        Some(_) => Err("choices[0].message.content is not text".into()),
    }
}

/// The chat completion request body sent to the provider.
pub fn request_body(p: &Provider, spec: &DecisionSpec, user_request: &str) -> Value {
    json!({
        "model": p.model,
        "messages": [
            {"role": "system", "content": system_prompt(spec)},
            {"role": "user", "content": truncate_chars(user_request, MAX_REQUEST_CHARS)},
        ],
        "max_tokens": MAX_ANSWER_TOKENS,
        "temperature": 0,
        "stream": false,
    })
}

fn one_line(s: &str) -> Cow<'_, str> {
    if s.contains(['\n', '\r']) {
        Cow::Owned(s.replace(['\n', '\r'], " "))
    } else {
        Cow::Borrowed(s)
    }
}

/// The system message: instructions, the numbered target list, [`ANSWER_RULE`].
pub fn system_prompt(spec: &DecisionSpec) -> String {
    let generated = generated_criteria(&spec.targets);
    let mut out = String::with_capacity(256 + spec.instructions.len());
    let instructions = spec.instructions.trim();
    if !instructions.is_empty() {
        out.push_str(instructions);
        out.push_str("\n\n");
    }
    out.push_str("Targets:\n");
    for (i, (t, fallback)) in spec.targets.iter().zip(&generated).enumerate() {
        let criteria = match t.criteria.as_deref().map(str::trim) {
            Some(c) if !c.is_empty() => c,
            _ => fallback,
        };
        out.push_str(&format!(
            "{}. {}: {}\n",
            i + 1,
            one_line(t.name.trim()),
            one_line(criteria)
        ));
    }
    out.push('\n');
    out.push_str(ANSWER_RULE);
    out
}

/// Model size in billions of parameters, from a name part such as `32b`, `0.6B` or `135m`.
pub fn size_from_name(name: &str) -> Option<f64> {
    name.rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))
        .find_map(|part| {
            let lower = part.to_ascii_lowercase();
            let (num, per_billion) = if let Some(n) = lower.strip_suffix('b') {
                (n, 1.0)
            } else if let Some(n) = lower.strip_suffix('m') {
                (n, 1000.0)
            } else {
                return None;
            };
            let x: f64 = num.parse().ok()?;
            (x.is_finite() && x > 0.0 && num.as_bytes()[0].is_ascii_digit())
                .then_some(x / per_billion)
        })
}

/// Criteria for every target as if none were configured (used for those without criteria):
/// "the model `name`", its size when the name carries one, and when two or more sizes differ
/// a use hint for the smallest and the largest.
pub fn generated_criteria(targets: &[TargetCriteria]) -> Vec<String> {
    let sizes: Vec<Option<f64>> = targets.iter().map(|t| size_from_name(&t.name)).collect();
    let known = sizes.iter().flatten().copied();
    let min = known.clone().fold(f64::INFINITY, f64::min);
    let max = known.fold(f64::NEG_INFINITY, f64::max);
    let spread = min.is_finite() && max > min;
    targets
        .iter()
        .zip(&sizes)
        .map(|(t, size)| {
            let mut s = format!("the model `{}`", t.name.trim());
            if let Some(b) = size {
                s.push_str(&format!(", about {b}B parameters"));
                if spread && *b == min {
                    s.push_str(
                        ": the smallest listed, fastest and cheapest; for short, simple requests \
                         such as greetings, small talk and quick factual questions",
                    );
                } else if spread && *b == max {
                    s.push_str(
                        ": the largest listed, most capable; for complex requests such as \
                         reasoning, math, proofs and code",
                    );
                }
            }
            s
        })
        .collect()
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn strip_think(answer: &str) -> &str {
    match answer.rfind("</think>") {
        Some(i) => &answer[i + "</think>".len()..],
        None => answer,
    }
}

/// The target an answer names (see the module docs), as an index into `targets`.
pub fn parse_answer(answer: &str, targets: &[TargetCriteria]) -> Option<usize> {
    let answer = strip_think(answer);
    let trimmed = answer.trim_matches(|c: char| {
        c.is_whitespace()
            || "\"'`*_.,;:!?()[]{}<>".contains(c)
            || c == '\u{201c}'
            || c == '\u{201d}'
    });
    if trimmed.is_empty() {
        return None;
    }
    let lower = trimmed.to_lowercase();
    let names: Vec<String> = targets
        .iter()
        .map(|t| t.name.trim().to_lowercase())
        .collect();
    if let Some(i) = names.iter().position(|n| *n == lower) {
        return Some(i);
    }
    if let Ok(n) = trimmed.parse::<usize>() {
        if (1..=targets.len()).contains(&n) {
            return Some(n - 1);
        }
    }
    // Longest names first; each claims the text it matched.
    let hay = answer.to_lowercase();
    let mut order: Vec<usize> = (0..names.len()).filter(|&i| !names[i].is_empty()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(names[i].len()));
    let mut claimed: Vec<Range<usize>> = Vec::new();
    let mut found: Option<usize> = None;
    for i in order {
        let name = &names[i];
        let mut hit = false;
        for (pos, _) in hay.match_indices(name.as_str()) {
            let r = pos..pos + name.len();
            let before = hay[..r.start].chars().next_back();
            let after = hay[r.end..].chars().next();
            if before.is_some_and(is_word_char) || after.is_some_and(is_word_char) {
                continue;
            }
            if claimed.iter().any(|c| c.start < r.end && r.start < c.end) {
                continue;
            }
            claimed.push(r);
            hit = true;
        }
        if hit {
            match found {
                None => found = Some(i),
                Some(j) if names[j] == *name => {}
                Some(_) => return None,
            }
        }
    }
    found
}

/// The first `max` characters of `s`.
pub fn truncate_chars(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The turns of a rendered prompt (`<|role|>\n` markers at line starts): for each, the
/// marker's start, the role and where the content starts.
fn turns(prompt: &str) -> Vec<(usize, &str, usize)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(off) = prompt[pos..].find("<|") {
        let start = pos + off;
        pos = start + 2;
        if start > 0 && prompt.as_bytes()[start - 1] != b'\n' {
            continue;
        }
        let rest = &prompt[start + 2..];
        let role_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
            .count();
        if role_len > 0 && rest[role_len..].starts_with("|>\n") {
            out.push((start, &rest[..role_len], start + 2 + role_len + 3));
            pos = start + 2 + role_len + 3;
        }
    }
    out
}

/// The text to decide on from a gateway-rendered prompt ([`crate::api::RequestInfo::prompt`]:
/// `<|role|>\ncontent\n` turns): the last user turn's content; without one, the content of
/// the last turn; without turns (completions), the whole prompt. Trimmed and cut to
/// [`MAX_REQUEST_CHARS`].
pub fn request_text(prompt_rendered: &str) -> &str {
    let t = turns(prompt_rendered);
    let text = match t.iter().rposition(|(_, role, _)| *role == "user") {
        Some(k) => {
            let end = t.get(k + 1).map_or(prompt_rendered.len(), |n| n.0);
            &prompt_rendered[t[k].2..end]
        }
        None => match t.last() {
            Some(&(_, _, content)) => &prompt_rendered[content..],
            None => prompt_rendered,
        },
    };
    truncate_chars(text.trim(), MAX_REQUEST_CHARS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_sim::{Faults, SimConfig, SimHandle};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn targets(names: &[&str]) -> Vec<TargetCriteria> {
        names
            .iter()
            .map(|n| TargetCriteria {
                name: n.to_string(),
                criteria: None,
            })
            .collect()
    }

    const GREETING: &str = "Write a one-line greeting card.";
    const PROOF: &str =
        "Prove that there are infinitely many primes, then implement the proof sketch in Python.";

    fn seed_spec() -> DecisionSpec {
        DecisionSpec::new(
            "Route each request to the model that fits it best.",
            vec![
                TargetCriteria {
                    name: "qwen3-0.6b".into(),
                    criteria: Some(
                        "short factual questions, greetings, small talk, simple one-line writing"
                            .into(),
                    ),
                },
                TargetCriteria {
                    name: "qwen3-32b".into(),
                    criteria: Some(
                        "reasoning, math, proofs, prove, code, programming, python, implement, \
                         algorithms"
                            .into(),
                    ),
                },
            ],
        )
    }

    #[test]
    fn answer_exact_and_trimmed() {
        let t = targets(&["qwen3-0.6b", "qwen3-32b"]);
        assert_eq!(parse_answer("qwen3-32b", &t), Some(1));
        assert_eq!(parse_answer("  QWEN3-0.6B \n", &t), Some(0));
        assert_eq!(parse_answer("\"qwen3-32b\".", &t), Some(1));
        assert_eq!(parse_answer("`qwen3-0.6b`", &t), Some(0));
        assert_eq!(parse_answer("**qwen3-32b**", &t), Some(1));
        assert_eq!(
            parse_answer("<think>\nqwen3-0.6b? no.\n</think>\nqwen3-32b", &t),
            Some(1)
        );
        assert_eq!(parse_answer("2", &t), Some(1));
        assert_eq!(parse_answer("3", &t), None);
        assert_eq!(parse_answer("", &t), None);
        assert_eq!(parse_answer(" .. ", &t), None);
    }

    #[test]
    fn answer_contained() {
        let t = targets(&["qwen3-0.6b", "qwen3-32b"]);
        assert_eq!(parse_answer("The best target is qwen3-32b.", &t), Some(1));
        assert_eq!(parse_answer("1. qwen3-0.6b", &t), Some(0));
        assert_eq!(parse_answer("Target: QWEN3-0.6B (small)", &t), Some(0));
        // two different names: ambiguous
        assert_eq!(parse_answer("qwen3-32b or qwen3-0.6b", &t), None);
        // the same name twice is fine
        assert_eq!(parse_answer("qwen3-32b, definitely qwen3-32b", &t), Some(1));
        // filler text names nothing
        assert_eq!(
            parse_answer("the model is a simulated engine that streams", &t),
            None
        );
    }

    #[test]
    fn answer_longest_name_wins() {
        let t = targets(&["qwen3-3", "qwen3-32b", "qwen3"]);
        assert_eq!(parse_answer("use qwen3-32b", &t), Some(1));
        assert_eq!(parse_answer("use qwen3-3", &t), Some(0));
        assert_eq!(parse_answer("use qwen3 please", &t), Some(2));
        assert_eq!(parse_answer("qwen3-32b, not qwen3", &t), None);
        // whole words only: gpt-4 is not in gpt-4o
        let t = targets(&["gpt-4", "small"]);
        assert_eq!(parse_answer("gpt-4o", &t), None);
        assert_eq!(parse_answer("smaller", &t), None);
        assert_eq!(parse_answer("gpt-4, of course", &t), Some(0));
        // duplicate names: the first
        let t = targets(&["a-model", "A-Model"]);
        assert_eq!(parse_answer("a-model", &t), Some(0));
        assert_eq!(parse_answer("so: a-model", &t), Some(0));
    }

    #[test]
    fn system_prompt_format() {
        let mut spec = seed_spec();
        spec.targets.push(TargetCriteria {
            name: "other\nname".into(),
            criteria: Some("multi\nline".into()),
        });
        assert_eq!(
            system_prompt(&spec),
            "Route each request to the model that fits it best.\n\nTargets:\n\
             1. qwen3-0.6b: short factual questions, greetings, small talk, simple one-line writing\n\
             2. qwen3-32b: reasoning, math, proofs, prove, code, programming, python, implement, algorithms\n\
             3. other name: multi line\n\n\
             Answer with exactly one target name from the list and nothing else."
        );
        let no_instr = DecisionSpec::new("  ", targets(&["x"]));
        assert_eq!(
            system_prompt(&no_instr),
            "Targets:\n1. x: the model `x`\n\n".to_string() + ANSWER_RULE
        );
    }

    #[test]
    fn generated_criteria_hint_sizes() {
        assert_eq!(size_from_name("qwen3-32b"), Some(32.0));
        assert_eq!(size_from_name("Qwen3-0.6B-Instruct"), Some(0.6));
        assert_eq!(size_from_name("smollm-135m"), Some(0.135));
        assert_eq!(size_from_name("llama-3.1-70b"), Some(70.0));
        assert_eq!(size_from_name("gpt-4o-mini"), None);
        assert_eq!(size_from_name("jev-latest"), None);
        let g = generated_criteria(&targets(&["qwen3-0.6b", "qwen3-8b", "qwen3-32b", "gpt-x"]));
        assert!(g[0].starts_with("the model `qwen3-0.6b`, about 0.6B parameters: the smallest"));
        assert_eq!(g[1], "the model `qwen3-8b`, about 8B parameters");
        assert!(g[2].contains("the largest listed") && g[2].contains("proofs and code"));
        assert_eq!(g[3], "the model `gpt-x`");
        // one size only: no hint
        let g = generated_criteria(&targets(&["a-7b", "b-7b"]));
        assert_eq!(g[0], "the model `a-7b`, about 7B parameters");
        // configured criteria win over generated ones
        let p = system_prompt(&seed_spec());
        assert!(!p.contains("the model `"));
    }

    #[test]
    fn request_body_shape() {
        let p = Provider {
            name: "dec".into(),
            base_url: "http://127.0.0.1:1/v1/".into(),
            api_key: None,
            model: "jev-latest".into(),
        };
        assert_eq!(p.chat_url(), "http://127.0.0.1:1/v1/chat/completions");
        let long = "é".repeat(MAX_REQUEST_CHARS + 10);
        let b = request_body(&p, &seed_spec(), &long);
        assert_eq!(b["model"], "jev-latest");
        assert_eq!(b["max_tokens"], MAX_ANSWER_TOKENS);
        assert_eq!(b["temperature"], 0);
        assert_eq!(b["stream"], false);
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["messages"][0]["content"], system_prompt(&seed_spec()));
        assert_eq!(b["messages"][1]["role"], "user");
        let sent = b["messages"][1]["content"].as_str().unwrap();
        assert_eq!(sent.chars().count(), MAX_REQUEST_CHARS);
    }

    #[test]
    fn request_text_takes_the_last_user_turn() {
        let p = "<|tools|>\n[]\n<|system|>\nbe nice\n<|user|>\nfirst\n<|assistant|>\nok\n<|user|>\n Prove it.\nline two \n";
        assert_eq!(request_text(p), "Prove it.\nline two");
        let p = "<|system|>\ns\n<|user|>\nq <|x|> inline\n<|assistant|>\na\n";
        assert_eq!(request_text(p), "q <|x|> inline");
        // Responses API with instructions and a string input: no user marker
        assert_eq!(request_text("<|system|>\nS\nthe input"), "S\nthe input");
        // completions: the raw prompt
        assert_eq!(request_text("  raw prompt "), "raw prompt");
        let long = "x".repeat(MAX_REQUEST_CHARS * 2);
        assert_eq!(request_text(&long).len(), MAX_REQUEST_CHARS);
        assert_eq!(truncate_chars("héllo", 2), "hé");
    }

    #[test]
    fn answer_text_shapes() {
        let ok = br#"{"choices":[{"message":{"role":"assistant","content":"qwen3-32b"}}]}"#;
        assert_eq!(answer_text(ok).unwrap(), "qwen3-32b");
        let parts =
            br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"},{"text":"b"}]}}]}"#;
        assert_eq!(answer_text(parts).unwrap(), "ab");
        let null = br#"{"choices":[{"message":{"content":null}}]}"#;
        assert_eq!(answer_text(null).unwrap(), "");
        assert!(answer_text(b"not json").is_err());
        assert!(answer_text(br#"{"choices":[]}"#).is_err());
        assert!(answer_text(br#"{"choices":[{"message":{"content":5}}]}"#).is_err());
    }

    // ---- against engine-sim and a scripted server on 127.0.0.1:0 ----

    fn sim_cfg(decision_mode: bool) -> SimConfig {
        SimConfig {
            id: "decider".into(),
            model: "jev-latest".into(),
            time_scale: 20.0,
            decision_mode,
            ..SimConfig::default()
        }
    }

    fn provider_for(sim: &SimHandle) -> Provider {
        Provider {
            name: "jev".into(),
            base_url: format!("{}/v1", sim.url()),
            api_key: Some("sk-test".into()),
            model: "jev-latest".into(),
        }
    }

    #[tokio::test]
    async fn decision_model_routes_the_seed_examples() {
        let sim = engine_sim::spawn_local(sim_cfg(true)).await.unwrap();
        let p = provider_for(&sim);
        let c = DecisionClient::new();
        let spec = seed_spec();
        let (o, latency) = c.decide(&p, &spec, GREETING).await;
        assert_eq!(o, DecisionOutcome::Target(0), "{o}");
        assert!(latency > Duration::ZERO && latency < spec.timeout);
        let (o, _) = c.decide(&p, &spec, PROOF).await;
        assert_eq!(o, DecisionOutcome::Target(1), "{o}");
        assert_eq!(o.label(), "target");
        // generated criteria (sizes from the names) route the same way
        let generated = DecisionSpec::new("", targets(&["qwen3-0.6b", "qwen3-32b"]));
        assert_eq!(
            c.decide(&p, &generated, GREETING).await.0,
            DecisionOutcome::Target(0)
        );
        assert_eq!(
            c.decide(&p, &generated, PROOF).await.0,
            DecisionOutcome::Target(1)
        );
        // through the gateway's rendering of a multi-turn chat
        let rendered = format!(
            "<|system|>\nyou help\n<|user|>\n{GREETING}\n<|assistant|>\nok\n<|user|>\n{PROOF}\n"
        );
        let (o, _) = c.decide(&p, &spec, request_text(&rendered)).await;
        assert_eq!(o, DecisionOutcome::Target(1));
        sim.stop().await;
    }

    #[tokio::test]
    async fn filler_answer_abstains_with_no_target() {
        let sim = engine_sim::spawn_local(sim_cfg(false)).await.unwrap();
        let (o, _) = DecisionClient::new()
            .decide(&provider_for(&sim), &seed_spec(), GREETING)
            .await;
        match &o {
            DecisionOutcome::Abstain(AbstainReason::NoTarget(a)) => {
                assert!(!a.is_empty() && !a.contains("qwen3"), "{a:?}")
            }
            other => panic!("expected NoTarget, got {other:?}"),
        }
        assert_eq!(o.label(), "no_target");
        sim.stop().await;
    }

    #[tokio::test]
    async fn stalled_provider_times_out() {
        let c = DecisionClient::new();
        let mut spec = seed_spec();
        spec.timeout = Duration::from_millis(200);
        for faults in [
            Faults {
                stall_ms: 60_000,
                ..Faults::default()
            },
            Faults {
                first_byte_delay_ms: 60_000,
                ..Faults::default()
            },
        ] {
            let sim = engine_sim::spawn_local(SimConfig {
                faults,
                ..sim_cfg(true)
            })
            .await
            .unwrap();
            let (o, latency) = c.decide(&provider_for(&sim), &spec, PROOF).await;
            assert_eq!(o, DecisionOutcome::Abstain(AbstainReason::Timeout));
            assert_eq!(o.label(), "timeout");
            // Bounded by the spec's timeout (the outcome says so), not by a stopwatch here.
            assert!(latency >= spec.timeout, "{latency:?}");
            sim.stop().await;
        }
    }

    #[tokio::test]
    async fn provider_errors_abstain() {
        let c = DecisionClient::new();
        let spec = seed_spec();
        // 503 from the engine
        let sim = engine_sim::spawn_local(SimConfig {
            faults: Faults {
                error_rate: 1.0,
                ..Faults::default()
            },
            ..sim_cfg(true)
        })
        .await
        .unwrap();
        let (o, _) = c.decide(&provider_for(&sim), &spec, PROOF).await;
        match &o {
            DecisionOutcome::Abstain(AbstainReason::Error(e)) => assert!(e.contains("503"), "{e}"),
            other => panic!("expected Error, got {other:?}"),
        }
        assert_eq!(o.label(), "error");
        // unknown model: 404
        let mut p = provider_for(&sim);
        p.model = "nope".into();
        sim.set_faults(Faults::default());
        let (o, _) = c.decide(&p, &spec, PROOF).await;
        assert!(
            matches!(o, DecisionOutcome::Abstain(AbstainReason::Error(ref e)) if e.contains("404")),
            "{o}"
        );
        // connection reset
        sim.set_faults(Faults {
            refuse: true,
            ..Faults::default()
        });
        let (o, _) = c.decide(&provider_for(&sim), &spec, PROOF).await;
        assert_eq!(o.label(), "error", "{o}");
        sim.stop().await;
        // no targets: no call at all
        let empty = DecisionSpec::new("x", vec![]);
        assert_eq!(c.decide(&p, &empty, PROOF).await.0.label(), "error");
    }

    /// Serves one HTTP/1.1 request with `status` and `body`; returns the raw request.
    async fn one_shot(
        status: &'static str,
        body: &'static str,
    ) -> (String, tokio::task::JoinHandle<String>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", l.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let n = s.read(&mut chunk).await.unwrap();
                assert!(n > 0, "client closed early");
                buf.extend_from_slice(&chunk[..n]);
                let mut headers = [httparse::EMPTY_HEADER; 32];
                let mut req = httparse::Request::new(&mut headers);
                if let Ok(httparse::Status::Complete(head)) = req.parse(&buf) {
                    let len: usize = req
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                        .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                        .unwrap_or(0);
                    if buf.len() >= head + len {
                        break;
                    }
                }
            }
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            s.write_all(resp.as_bytes()).await.unwrap();
            String::from_utf8(buf).unwrap()
        });
        (url, task)
    }

    #[tokio::test]
    async fn sends_bearer_and_parses_a_real_shaped_answer() {
        let (url, task) = one_shot(
            "200 OK",
            r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"<think>\n\n</think>\n\nqwen3-32b"},"finish_reason":"stop"}]}"#,
        )
        .await;
        let p = Provider {
            name: "jev".into(),
            base_url: url,
            api_key: Some("sk-secret".into()),
            model: "jev-latest".into(),
        };
        let (o, _) = DecisionClient::new().decide(&p, &seed_spec(), PROOF).await;
        assert_eq!(o, DecisionOutcome::Target(1));
        let req = task.await.unwrap();
        assert!(
            req.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
            "{req}"
        );
        assert!(
            req.to_ascii_lowercase()
                .contains("authorization: bearer sk-secret\r\n"),
            "{req}"
        );
        let body: Value = serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body, request_body(&p, &seed_spec(), PROOF));
    }

    #[tokio::test]
    async fn bad_json_and_no_key() {
        let (url, task) = one_shot("200 OK", "{not json").await;
        let p = Provider {
            name: "jev".into(),
            base_url: url,
            api_key: None,
            model: "m".into(),
        };
        let (o, _) = DecisionClient::new()
            .decide(&p, &seed_spec(), GREETING)
            .await;
        assert!(
            matches!(o, DecisionOutcome::Abstain(AbstainReason::Error(ref e)) if e.contains("not JSON")),
            "{o}"
        );
        let req = task.await.unwrap();
        assert!(
            !req.to_ascii_lowercase().contains("authorization:"),
            "{req}"
        );
    }
}
