//! Request parsing, prompt rendering and response formatting for the four
//! APIs (OpenAI chat/completions, OpenAI Responses, Anthropic Messages).

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::engine::Usage;
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

const WORDS: &[&str] = &[
    "the",
    "model",
    "is",
    "a",
    "simulated",
    "engine",
    "that",
    "streams",
    "tokens",
    "with",
    "continuous",
    "batching",
    "and",
    "prefix",
    "caching",
    "for",
    "testing",
    "gateways",
    "under",
    "load",
    "while",
    "latency",
    "grows",
    "as",
    "more",
    "requests",
    "share",
    "one",
    "batch",
    "of",
    "decode",
    "steps",
];

/// Append the text of tokens `from..to` (one word per token).
pub(crate) fn push_tokens(out: &mut String, seed: u64, from: u32, to: u32) {
    for i in from..to {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[((seed + i as u64) % WORDS.len() as u64) as usize]);
    }
}

pub(crate) fn full_text(seed: u64, n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 7);
    push_tokens(&mut s, seed, 0, n);
    s
}

/// Static description of one response, shared by stream and non-stream.
pub(crate) struct Meta {
    pub api: Api,
    pub id: String,
    pub item_id: String,
    pub model: String,
    pub created: u64,
    pub seed: u64,
    pub length_limited: bool,
    pub include_usage: bool,
    pub target: u32,
    /// Decision mode: the answer text instead of filler words, 4 bytes per
    /// token ([`answer_tokens`]); `target` may cut it short.
    pub answer: Option<String>,
}

/// Output tokens needed for `answer` (4 bytes per token, at least 1).
pub(crate) fn answer_tokens(answer: &str) -> u32 {
    answer.len().div_ceil(4).max(1) as u32
}

impl Meta {
    /// Byte offset of the end of token `i` of the answer (on a char boundary;
    /// the last token takes the rest).
    fn answer_cut(answer: &str, i: u32) -> usize {
        if i >= answer_tokens(answer) {
            return answer.len();
        }
        let mut at = (i as usize * 4).min(answer.len());
        while !answer.is_char_boundary(at) {
            at -= 1;
        }
        at
    }

    /// Append the text of tokens `from..to`, JSON-escaped (no quotes).
    fn push_text(&self, out: &mut String, from: u32, to: u32) {
        match &self.answer {
            None => push_tokens(out, self.seed, from, to),
            Some(a) => {
                let piece = &a[Self::answer_cut(a, from)..Self::answer_cut(a, to)];
                let quoted = Value::String(piece.to_string()).to_string();
                out.push_str(&quoted[1..quoted.len() - 1]);
            }
        }
    }

    /// The whole text of `n` generated tokens.
    fn text(&self, n: u32) -> String {
        match &self.answer {
            None => full_text(self.seed, n),
            Some(a) => a[..Self::answer_cut(a, n)].to_string(),
        }
    }

    fn finish_reason(&self) -> &'static str {
        match (self.api, self.length_limited) {
            (Api::Messages, true) => "max_tokens",
            (Api::Messages, false) => "end_turn",
            (_, true) => "length",
            (_, false) => "stop",
        }
    }

    fn openai_usage(u: &Usage) -> Value {
        json!({
            "prompt_tokens": u.prompt,
            "total_tokens": u.prompt + u.completion,
            "completion_tokens": u.completion,
            "prompt_tokens_details": {"cached_tokens": u.cached},
        })
    }

    fn responses_usage(u: &Usage) -> Value {
        json!({
            "input_tokens": u.prompt,
            "input_tokens_details": {"cached_tokens": u.cached},
            "output_tokens": u.completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt + u.completion,
        })
    }

    /// Anthropic semantics: `input_tokens` excludes cache reads.
    fn anthropic_usage(u: &Usage) -> Value {
        json!({
            "input_tokens": u.prompt - u.cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached,
            "output_tokens": u.completion,
        })
    }

    fn response_object(&self, status: &str, text: Option<&str>, usage: Option<&Usage>) -> Value {
        let incomplete = status == "incomplete";
        let output = match text {
            Some(t) => json!([{
                "type": "message",
                "id": self.item_id,
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": t, "annotations": []}],
            }]),
            None => json!([]),
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": null,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage.map(Self::responses_usage),
        })
    }

    fn responses_status(&self) -> &'static str {
        if self.length_limited {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// Non-stream response body.
    pub(crate) fn full_response(&self, u: &Usage) -> Value {
        let text = self.text(u.completion);
        let fr = self.finish_reason();
        match self.api {
            Api::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null,
                    "finish_reason": fr,
                    "stop_reason": null,
                }],
                "usage": Self::openai_usage(u),
                "prompt_logprobs": null,
            }),
            Api::Completions => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": fr,
                    "stop_reason": null,
                    "prompt_logprobs": null,
                }],
                "usage": Self::openai_usage(u),
            }),
            Api::Responses => self.response_object(self.responses_status(), Some(&text), Some(u)),
            Api::Messages => json!({
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": fr,
                "stop_sequence": null,
                "usage": Self::anthropic_usage(u),
            }),
        }
    }
}

/// Incremental SSE formatter for one streamed response.
pub(crate) struct StreamFmt {
    pub meta: Meta,
    /// Prefix of every token chunk, up to the opening quote of the text.
    head: String,
    /// Suffix of a non-final token chunk.
    tail: String,
    /// Suffix of the final token chunk.
    tail_last: String,
    sent: u32,
    seq: u64,
    prompt: u32,
    pub chunks: u64,
    pub finished: bool,
    /// Cached prompt tokens once admitted to the batch; `None` while queued.
    admitted: Option<u32>,
}

fn sse(out: &mut String, event: Option<&str>, data: &Value) {
    if let Some(e) = event {
        let _ = writeln!(out, "event: {e}");
    }
    let _ = write!(out, "data: {data}\n\n");
}

impl StreamFmt {
    pub(crate) fn new(meta: Meta, prompt_tokens: u32) -> Self {
        let id = Value::String(meta.id.clone());
        let model = Value::String(meta.model.clone());
        let fr = meta.finish_reason();
        let (head, tail, tail_last) = match meta.api {
            Api::Chat => (
                format!(
                    "data: {{\"id\":{id},\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":{model},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"",
                    meta.created
                ),
                "\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n".to_string(),
                format!("\"}},\"logprobs\":null,\"finish_reason\":\"{fr}\"}}]}}\n\n"),
            ),
            Api::Completions => (
                format!(
                    "data: {{\"id\":{id},\"object\":\"text_completion\",\"created\":{},\"model\":{model},\"choices\":[{{\"index\":0,\"text\":\"",
                    meta.created
                ),
                "\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n".to_string(),
                format!("\",\"logprobs\":null,\"finish_reason\":\"{fr}\",\"stop_reason\":null}}]}}\n\n"),
            ),
            Api::Responses => (
                format!(
                    "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"item_id\":{},\"output_index\":0,\"content_index\":0,\"logprobs\":[],\"delta\":\"",
                    Value::String(meta.item_id.clone())
                ),
                // sequence_number is appended per chunk
                "\",\"sequence_number\":".to_string(),
                String::new(),
            ),
            Api::Messages => (
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"".to_string(),
                "\"}}\n\n".to_string(),
                "\"}}\n\n".to_string(),
            ),
        };
        StreamFmt {
            meta,
            head,
            tail,
            tail_last,
            sent: 0,
            seq: 0,
            prompt: prompt_tokens,
            chunks: 0,
            finished: false,
            admitted: None,
        }
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// Events sent as soon as the stream starts.
    pub(crate) fn start(&mut self, out: &mut String) {
        if self.meta.api == Api::Responses {
            let r = self.meta.response_object("in_progress", None, None);
            let s = self.next_seq();
            sse(
                out,
                Some("response.created"),
                &json!({"type": "response.created", "sequence_number": s, "response": r}),
            );
            let s = self.next_seq();
            sse(
                out,
                Some("response.in_progress"),
                &json!({"type": "response.in_progress", "sequence_number": s, "response": r}),
            );
            let s = self.next_seq();
            sse(
                out,
                Some("response.output_item.added"),
                &json!({
                    "type": "response.output_item.added", "sequence_number": s, "output_index": 0,
                    "item": {"type": "message", "id": self.meta.item_id, "status": "in_progress", "role": "assistant", "content": []},
                }),
            );
            let s = self.next_seq();
            sse(
                out,
                Some("response.content_part.added"),
                &json!({
                    "type": "response.content_part.added", "sequence_number": s, "item_id": self.meta.item_id,
                    "output_index": 0, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }),
            );
        }
    }

    /// Events sent when the request is admitted to the batch.
    pub(crate) fn admitted(&mut self, out: &mut String, cached: u32) {
        self.admitted = Some(cached);
        match self.meta.api {
            Api::Chat => {
                // head ends with `"content":"`; insert the role before it
                out.push_str(&self.head[..self.head.len() - "\"content\":\"".len()]);
                out.push_str("\"role\":\"assistant\",\"content\":\"");
                out.push_str(&self.tail);
            }
            Api::Messages => {
                let u = Usage {
                    prompt: self.prompt,
                    cached,
                    completion: 1,
                };
                sse(
                    out,
                    Some("message_start"),
                    &json!({"type": "message_start", "message": {
                        "id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
                        "content": [], "stop_reason": null, "stop_sequence": null,
                        "usage": Meta::anthropic_usage(&u),
                    }}),
                );
                sse(
                    out,
                    Some("content_block_start"),
                    &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                );
            }
            _ => {}
        }
    }

    /// One content chunk carrying the tokens generated up to `upto`.
    pub(crate) fn tokens(&mut self, out: &mut String, upto: u32) {
        if upto <= self.sent {
            return;
        }
        out.push_str(&self.head);
        self.meta.push_text(out, self.sent, upto);
        self.sent = upto;
        self.chunks += 1;
        if self.meta.api == Api::Responses {
            out.push_str(&self.tail);
            let s = self.next_seq();
            let _ = write!(out, "{s}}}\n\n");
        } else if upto >= self.meta.target {
            out.push_str(&self.tail_last);
        } else {
            out.push_str(&self.tail);
        }
    }

    /// An error after the stream started, in the API's own shape, then the end.
    pub(crate) fn failed(&mut self, out: &mut String, status: u16, message: &str) {
        self.finished = true;
        match self.meta.api {
            Api::Chat | Api::Completions => {
                sse(out, None, &error_body(Some(self.meta.api), status, message));
                out.push_str("data: [DONE]\n\n");
            }
            Api::Responses => {
                let s = self.next_seq();
                sse(
                    out,
                    Some("error"),
                    &json!({"type": "error", "code": status.to_string(), "message": message, "param": null, "sequence_number": s}),
                );
            }
            Api::Messages => sse(
                out,
                Some("error"),
                &error_body(Some(Api::Messages), status, message),
            ),
        }
    }

    /// The end of a stream aborted by `POST /abort_request` (SGLang: a graceful
    /// abort ends the normal way, with `finish_reason` `"abort"`). Chat and
    /// completions: a final chunk with `finish_reason: "abort"`, the usage chunk
    /// (if asked for) and `[DONE]`. The Responses and Messages APIs have no such
    /// finish reason: their error event, as [`failed`](Self::failed) with 500.
    pub(crate) fn aborted(&mut self, out: &mut String, message: &str) {
        let m = &self.meta;
        let (obj, choice) = match m.api {
            Api::Chat => {
                let delta = if self.admitted.is_some() {
                    json!({})
                } else {
                    json!({"role": "assistant", "content": ""})
                };
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": "abort"}),
                )
            }
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "abort", "stop_reason": null}),
            ),
            Api::Responses | Api::Messages => return self.failed(out, 500, message),
        };
        self.finished = true;
        sse(
            out,
            None,
            &json!({"id": m.id, "object": obj, "created": m.created, "model": m.model, "choices": [choice]}),
        );
        if m.include_usage {
            let u = Usage {
                prompt: self.prompt,
                cached: self.admitted.unwrap_or(0),
                completion: self.sent,
            };
            sse(
                out,
                None,
                &json!({
                    "id": m.id, "object": obj, "created": m.created, "model": m.model,
                    "choices": [], "usage": Meta::openai_usage(&u),
                }),
            );
        }
        out.push_str("data: [DONE]\n\n");
    }

    /// Closing events.
    pub(crate) fn done(&mut self, out: &mut String, u: &Usage) {
        self.finished = true;
        let m = &self.meta;
        match m.api {
            Api::Chat | Api::Completions => {
                if m.include_usage {
                    let obj = if m.api == Api::Chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    sse(
                        out,
                        None,
                        &json!({
                            "id": m.id, "object": obj, "created": m.created, "model": m.model,
                            "choices": [], "usage": Meta::openai_usage(u),
                        }),
                    );
                }
                out.push_str("data: [DONE]\n\n");
            }
            Api::Responses => {
                let text = m.text(u.completion);
                let item_id = m.item_id.clone();
                let status = m.responses_status();
                let full = m.response_object(status, Some(&text), Some(u));
                let s = self.next_seq();
                sse(
                    out,
                    Some("response.output_text.done"),
                    &json!({
                        "type": "response.output_text.done", "sequence_number": s, "item_id": item_id,
                        "output_index": 0, "content_index": 0, "text": text, "logprobs": [],
                    }),
                );
                let s = self.next_seq();
                sse(
                    out,
                    Some("response.content_part.done"),
                    &json!({
                        "type": "response.content_part.done", "sequence_number": s, "item_id": item_id,
                        "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": text, "annotations": []},
                    }),
                );
                let s = self.next_seq();
                sse(
                    out,
                    Some("response.output_item.done"),
                    &json!({
                        "type": "response.output_item.done", "sequence_number": s, "output_index": 0,
                        "item": full["output"][0],
                    }),
                );
                let s = self.next_seq();
                let ev = if status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                sse(
                    out,
                    Some(ev),
                    &json!({"type": ev, "sequence_number": s, "response": full}),
                );
            }
            Api::Messages => {
                sse(
                    out,
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": 0}),
                );
                sse(
                    out,
                    Some("message_delta"),
                    &json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": m.finish_reason(), "stop_sequence": null},
                        "usage": Meta::anthropic_usage(u),
                    }),
                );
                sse(out, Some("message_stop"), &json!({"type": "message_stop"}));
            }
        }
    }
}

/// An error body in the API's own shape.
pub(crate) fn error_body(api: Option<Api>, status: u16, message: &str) -> Value {
    if api == Some(Api::Messages) {
        let ty = match status {
            400 => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            529 | 503 => "overloaded_error",
            _ => "api_error",
        };
        return json!({"type": "error", "error": {"type": ty, "message": message}});
    }
    let ty = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        429 => "RateLimitError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": ty, "param": null, "code": status}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_rendering() {
        let p = parse(
            Api::Chat,
            br#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_tokens":5}"#,
        )
        .unwrap();
        assert_eq!(p.prompt, b"<|system|>\nS\n<|user|>\nab\n");
        assert_eq!(p.max_tokens, Some(5));
        // the same conversation via the Anthropic API renders identically
        let q = parse(
            Api::Messages,
            br#"{"model":"m","system":"S","messages":[{"role":"user","content":"ab"}],"max_tokens":5}"#,
        )
        .unwrap();
        assert_eq!(p.prompt, q.prompt);
        let r = parse(Api::Responses, br#"{"instructions":"S","input":"ab"}"#).unwrap();
        assert_eq!(p.prompt, r.prompt);
    }

    #[test]
    fn chat_role_chunk_is_valid_json() {
        let meta = Meta {
            api: Api::Chat,
            id: "chatcmpl-1".into(),
            item_id: "x".into(),
            model: "m".into(),
            created: 1,
            seed: 0,
            length_limited: true,
            include_usage: true,
            target: 2,
            answer: None,
        };
        let mut f = StreamFmt::new(meta, 10);
        let mut out = String::new();
        f.admitted(&mut out, 0);
        f.tokens(&mut out, 1);
        f.tokens(&mut out, 2);
        f.done(
            &mut out,
            &Usage {
                prompt: 10,
                cached: 0,
                completion: 2,
            },
        );
        let events: Vec<&str> = out
            .split("\n\n")
            .filter(|s| !s.is_empty())
            .map(|s| s.strip_prefix("data: ").unwrap())
            .collect();
        assert_eq!(events.len(), 5);
        let v: Value = serde_json::from_str(events[0]).unwrap();
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v["choices"][0]["delta"]["content"], "");
        let v: Value = serde_json::from_str(events[2]).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(events[4], "[DONE]");
    }
}
