//! The question: the request body sent to the provider, its system message (with generated
//! criteria for targets without any) and the user text taken from a rendered prompt.

use std::borrow::Cow;

use serde_json::{json, Value};

use super::spec::{DecisionSpec, Provider, TargetCriteria};

/// `max_tokens` of the question: a target name is a few tokens.
pub const MAX_ANSWER_TOKENS: u64 = 16;
/// At most this many characters of the user's request are sent (the head of the text).
pub const MAX_REQUEST_CHARS: usize = 4000;
/// The last line of the system message.
pub const ANSWER_RULE: &str = "Answer with exactly one target name from the list and nothing else.";

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
