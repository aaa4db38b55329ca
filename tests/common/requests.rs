//! What the tests send (prompt text and chat completion bodies) and read back of routing.

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

/// The routing headers of an answer: `x-tokengate-instance` and `x-tokengate-reason`.
pub(crate) fn routed(r: &reqwest::Response) -> (String, String) {
    let h = |name: &str| r.headers()[name].to_str().unwrap().to_string();
    (h("x-tokengate-instance"), h("x-tokengate-reason"))
}

/// The share of `label`'s answers among those that ended after the first `before` answers,
/// up to `label`'s last: the window in which `label` and the others were both backlogged
/// (`order`: the labels in the order their answers ended). Prints the window.
pub(crate) fn share_while_backlogged(order: &[&str], before: usize, label: &str) -> f64 {
    let last = order.iter().rposition(|x| *x == label).unwrap();
    let window = &order[before..=last];
    let share = window.iter().filter(|x| **x == label).count() as f64 / window.len() as f64;
    eprintln!("{label} share {share:.2} over {window:?}");
    share
}
