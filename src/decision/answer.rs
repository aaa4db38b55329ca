//! The answer: its text out of a chat completion body, and the target it names.

use std::ops::Range;

use serde_json::Value;

use super::spec::TargetCriteria;

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
