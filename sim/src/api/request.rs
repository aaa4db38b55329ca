//! The requests of the four APIs: parsing a body and rendering its prompt (the text the
//! engine caches and counts), and the decision-service texts.

use serde_json::Value;

use crate::pd::PdFields;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    Chat,
    Completions,
    Responses,
    Messages,
}

#[derive(Debug)]
pub(crate) struct Parsed {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub prompt: Vec<u8>,
    pub max_tokens: Option<u64>,
    /// Prefill/decode disaggregation fields (SGLang bootstrap, vLLM kv_transfer_params).
    pub pd: PdFields,
    /// SGLang's request id: `POST /abort_request {"rid"}` aborts the request.
    pub rid: Option<String>,
}

/// Render a message-like `content`: a string, or an array of parts whose text
/// (`text` field, or nested `content` for tool results) is concatenated;
/// non-text parts render as their JSON.
fn render_content(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => {}
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        Value::Array(parts) => {
            for p in parts {
                match p {
                    Value::String(s) => out.extend_from_slice(s.as_bytes()),
                    Value::Object(o) => {
                        if let Some(Value::String(t)) = o.get("text") {
                            out.extend_from_slice(t.as_bytes());
                        } else if let Some(c @ (Value::String(_) | Value::Array(_))) =
                            o.get("content")
                        {
                            render_content(out, c);
                        } else {
                            out.extend_from_slice(p.to_string().as_bytes());
                        }
                    }
                    other => out.extend_from_slice(other.to_string().as_bytes()),
                }
            }
        }
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

fn render_turn(out: &mut Vec<u8>, role: &str, content: &Value) {
    out.extend_from_slice(b"<|");
    out.extend_from_slice(role.as_bytes());
    out.extend_from_slice(b"|>\n");
    render_content(out, content);
    out.push(b'\n');
}

fn render_tools(out: &mut Vec<u8>, body: &Value) {
    if let Some(t @ Value::Array(a)) = body.get("tools") {
        if !a.is_empty() {
            render_turn(out, "tools", &Value::String(t.to_string()));
        }
    }
}

/// Render a list of role/content messages; extra fields such as `tool_calls`
/// are appended as JSON after the content.
fn render_messages(out: &mut Vec<u8>, msgs: &Value) -> Result<(), String> {
    let Value::Array(msgs) = msgs else {
        return Err("'messages' must be an array".into());
    };
    for m in msgs {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let mut content = m.get("content").cloned().unwrap_or(Value::Null);
        if let Some(tc) = m.get("tool_calls") {
            let mut buf = Vec::new();
            render_content(&mut buf, &content);
            buf.extend_from_slice(tc.to_string().as_bytes());
            content = Value::String(String::from_utf8_lossy(&buf).into_owned());
        }
        render_turn(out, role, &content);
    }
    Ok(())
}

fn opt_u64(body: &Value, keys: &[&str]) -> Option<u64> {
    keys.iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
}

pub(crate) fn parse(api: Api, raw: &[u8]) -> Result<Parsed, String> {
    let body: Value = serde_json::from_slice(raw).map_err(|e| format!("invalid JSON body: {e}"))?;
    if !body.is_object() {
        return Err("request body must be a JSON object".into());
    }
    let model = body.get("model").and_then(Value::as_str).map(str::to_owned);
    let rid = match body.get("rid") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(_)) => {
            return Err("engine-sim does not support batched requests (rid arrays)".into())
        }
        Some(other) => return Err(format!("rid must be a string, got {other}")),
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut prompt = Vec::new();
    let max_tokens = match api {
        Api::Chat => {
            let msgs = body.get("messages").ok_or("'messages' is required")?;
            render_tools(&mut prompt, &body);
            render_messages(&mut prompt, msgs)?;
            opt_u64(&body, &["max_completion_tokens", "max_tokens"])
        }
        Api::Completions => {
            match body.get("prompt").ok_or("'prompt' is required")? {
                Value::String(s) => prompt.extend_from_slice(s.as_bytes()),
                Value::Array(a) if a.iter().all(Value::is_u64) && !a.is_empty() => {
                    // token ids: exactly one simulated token each
                    for t in a {
                        let id = t.as_u64().unwrap_or(0) as u32;
                        prompt.extend_from_slice(&id.to_le_bytes());
                    }
                }
                Value::Array(a) => match a.first() {
                    Some(Value::String(s)) => prompt.extend_from_slice(s.as_bytes()),
                    _ => return Err("unsupported 'prompt'".into()),
                },
                _ => return Err("'prompt' must be a string or an array".into()),
            }
            opt_u64(&body, &["max_tokens"])
        }
        Api::Responses => {
            if let Some(i) = body.get("instructions") {
                if !i.is_null() {
                    render_turn(&mut prompt, "system", i);
                }
            }
            render_tools(&mut prompt, &body);
            match body.get("input").ok_or("'input' is required")? {
                Value::String(s) => render_turn(&mut prompt, "user", &Value::String(s.clone())),
                Value::Array(items) => {
                    for it in items {
                        if let Some(role) = it.get("role").and_then(Value::as_str) {
                            let c = it.get("content").cloned().unwrap_or(Value::Null);
                            render_turn(&mut prompt, role, &c);
                        } else {
                            let ty = it.get("type").and_then(Value::as_str).unwrap_or("item");
                            render_turn(&mut prompt, ty, &Value::String(it.to_string()));
                        }
                    }
                }
                _ => return Err("'input' must be a string or an array".into()),
            }
            opt_u64(&body, &["max_output_tokens"])
        }
        Api::Messages => {
            render_tools(&mut prompt, &body);
            if let Some(s) = body.get("system") {
                if !s.is_null() {
                    render_turn(&mut prompt, "system", s);
                }
            }
            let msgs = body.get("messages").ok_or("'messages' is required")?;
            render_messages(&mut prompt, msgs)?;
            Some(opt_u64(&body, &["max_tokens"]).ok_or("'max_tokens' is required")?)
        }
    };
    Ok(Parsed {
        model,
        stream,
        include_usage,
        prompt,
        max_tokens,
        pd: PdFields::from_body(&body),
        rid,
    })
}

fn content_text(v: &Value) -> String {
    let mut buf = Vec::new();
    render_content(&mut buf, v);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Decision mode: the system text (system/developer messages, Anthropic
/// `system`, Responses `instructions`, joined by newlines) and the text of
/// the last user message of a request body. `None` for the completions API
/// and for bodies that do not parse.
pub(crate) fn decision_texts(api: Api, raw: &[u8]) -> Option<(String, String)> {
    fn messages(items: &Value, system: &mut Vec<String>, user: &mut String) {
        for m in items.as_array().into_iter().flatten() {
            let content = m.get("content").unwrap_or(&Value::Null);
            match m.get("role").and_then(Value::as_str) {
                Some("system" | "developer") => system.push(content_text(content)),
                Some("user") => *user = content_text(content),
                _ => {}
            }
        }
    }
    let body: Value = serde_json::from_slice(raw).ok()?;
    let mut system = Vec::new();
    let mut user = String::new();
    match api {
        Api::Completions => return None,
        Api::Chat => messages(body.get("messages")?, &mut system, &mut user),
        Api::Messages => {
            if let Some(s) = body.get("system") {
                system.push(content_text(s));
            }
            messages(body.get("messages")?, &mut system, &mut user);
        }
        Api::Responses => {
            if let Some(i) = body.get("instructions") {
                system.push(content_text(i));
            }
            match body.get("input")? {
                Value::String(s) => user = s.clone(),
                items => messages(items, &mut system, &mut user),
            }
        }
    }
    Some((system.join("\n"), user))
}
