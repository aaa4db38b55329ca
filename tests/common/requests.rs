//! What the tests send: prompt text and chat completion bodies.

use serde_json::{json, Value};

/// `n` distinct words `{tag}0 {tag}1 …` (each followed by a space): a prompt of about `n`
/// tokens, different for every tag.
pub(crate) fn words(tag: &str, n: usize) -> String {
    (0..n).map(|i| format!("{tag}{i} ")).collect()
}

/// A chat completion body for the model `m`: a system message (none when `system` is
/// empty), the user message, `max_tokens` and `stream`.
pub(crate) fn chat(system: &str, user: &str, max_tokens: u64, stream: bool) -> Value {
    let mut messages = Vec::new();
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.push(json!({"role": "user", "content": user}));
    json!({"model": "m", "max_tokens": max_tokens, "stream": stream, "messages": messages})
}
