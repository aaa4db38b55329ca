//! The client-facing APIs: which paths exist, and what the gateway reads from a request body.
//!
//! One pass of borrowed serde over the body gives a [`RequestInfo`]: model, stream flag, the
//! prompt rendered as text (system, tools, every message in order: the routing key for prefix
//! caching), a token estimate, the requested output length and the session-key candidates.
//! Nothing here allocates a copy of the body; the prompt text is the only owned rendering.

use crate::error::GatewayError;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// Bytes per token used for estimates (the engines' average for English text and code).
pub const BYTES_PER_TOKEN: usize = 4;

/// The inference APIs tokengate proxies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    Responses,
    Messages,
}

impl Api {
    /// The API served at `path` (query string already stripped).
    pub fn from_path(path: &str) -> Option<Api> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Api::ChatCompletions),
            "/v1/completions" => Some(Api::Completions),
            "/v1/responses" => Some(Api::Responses),
            "/v1/messages" => Some(Api::Messages),
            _ => None,
        }
    }

    /// Anthropic-shaped errors on `/v1/messages`.
    pub fn is_anthropic(self) -> bool {
        self == Api::Messages
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::ChatCompletions => "chat.completions",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }

    /// Whether the API takes `stream_options.include_usage` (OpenAI's two legacy APIs).
    /// The Responses and Messages APIs always report usage at the end of a stream.
    pub fn has_stream_options(self) -> bool {
        matches!(self, Api::ChatCompletions | Api::Completions)
    }
}

/// What routing needs to know about a request.
#[derive(Debug, Clone, Default)]
pub struct RequestInfo {
    pub model: String,
    pub stream: bool,
    /// The client asked for `stream_options.include_usage: true`.
    pub client_wants_usage: bool,
    /// The body has a `stream_options` object at all.
    pub has_stream_options: bool,
    /// The prompt rendered as text: system, tools, then every message as `<|role|>\ncontent\n`.
    pub prompt: String,
    pub prompt_tokens_est: u64,
    /// `max_tokens` / `max_completion_tokens` / `max_output_tokens`, if given.
    pub max_tokens: Option<u64>,
    /// Body-level session key candidates.
    pub prompt_cache_key: Option<String>,
    pub user: Option<String>,
    pub metadata_user_id: Option<String>,
}

impl RequestInfo {
    /// Prompt estimate plus expected output (see [`crate::load::MeanOutput::expected`]):
    /// the request's in-flight tokens (`least-token`).
    pub fn expected_tokens(&self, output: &crate::load::MeanOutput) -> u64 {
        self.prompt_tokens_est + output.expected(self.max_tokens)
    }
}

#[derive(Deserialize)]
struct RawReq<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    metadata: Option<Metadata<'a>>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// Appends the text of a JSON value: a string as itself, an array of parts as their `text`
/// fields (other parts, e.g. images, as their raw JSON), anything else as raw JSON.
fn render_value(out: &mut String, v: &RawValue) {
    let raw = v.get();
    match raw.as_bytes().first() {
        // A string without escapes is its raw text between the quotes (the body was
        // validated when it was parsed); only escaped strings are decoded again.
        Some(b'"') if raw.len() >= 2 && memchr::memchr(b'\\', raw.as_bytes()).is_none() => {
            out.push_str(&raw[1..raw.len() - 1])
        }
        Some(b'"') => match serde_json::from_str::<Cow<str>>(raw) {
            Ok(s) => out.push_str(&s),
            Err(_) => out.push_str(raw),
        },
        Some(b'[') => match serde_json::from_str::<Vec<&RawValue>>(raw) {
            Ok(items) => {
                for item in items {
                    match serde_json::from_str::<Part>(item.get()) {
                        Ok(Part { text: Some(t) }) => out.push_str(&t),
                        _ => out.push_str(item.get()),
                    }
                }
            }
            Err(_) => out.push_str(raw),
        },
        _ => out.push_str(raw),
    }
}

/// Parses a request body of `api`. Errors are client errors (400) that say what is wrong.
pub fn parse_request(api: Api, body: &[u8]) -> Result<RequestInfo, GatewayError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(GatewayError::BadRequest(
            "request body is empty; expected a JSON object".into(),
        ));
    }
    let raw: RawReq = serde_json::from_slice(body)
        .map_err(|e| GatewayError::BadRequest(format!("invalid JSON body: {e}")))?;
    let model = match raw.model {
        Some(m) if !m.is_empty() => m.into_owned(),
        _ => {
            return Err(GatewayError::BadRequest(
                "missing required field `model`".into(),
            ))
        }
    };
    let mut prompt = String::with_capacity(body.len());
    // Same order as engine-sim's chat template: tools (raw JSON), then system, then messages.
    if let Some(t) = raw.tools {
        prompt.push_str("<|tools|>\n");
        prompt.push_str(t.get());
        prompt.push('\n');
    }
    for v in [raw.system, raw.instructions].into_iter().flatten() {
        prompt.push_str("<|system|>\n");
        render_value(&mut prompt, v);
        prompt.push('\n');
    }
    if let Some(msgs) = &raw.messages {
        for m in msgs {
            prompt.push_str("<|");
            prompt.push_str(m.role.as_deref().unwrap_or("user"));
            prompt.push_str("|>\n");
            if let Some(c) = m.content {
                render_value(&mut prompt, c);
            }
            if let Some(tc) = m.tool_calls {
                prompt.push_str(tc.get());
            }
            prompt.push('\n');
        }
    }
    if let Some(p) = raw.prompt.or(raw.input) {
        if api == Api::Responses && p.get().starts_with('[') {
            // Responses API input items: messages with role + content.
            if let Ok(items) = serde_json::from_str::<Vec<Message>>(p.get()) {
                for m in items {
                    prompt.push_str("<|");
                    prompt.push_str(m.role.as_deref().unwrap_or("user"));
                    prompt.push_str("|>\n");
                    if let Some(c) = m.content {
                        render_value(&mut prompt, c);
                    }
                    prompt.push('\n');
                }
            } else {
                render_value(&mut prompt, p);
            }
        } else {
            render_value(&mut prompt, p);
        }
    }
    let prompt_tokens_est = prompt.len().div_ceil(BYTES_PER_TOKEN) as u64;
    let (client_wants_usage, has_stream_options) = match &raw.stream_options {
        Some(so) => (so.include_usage.unwrap_or(false), true),
        None => (false, false),
    };
    Ok(RequestInfo {
        model,
        stream: raw.stream.unwrap_or(false),
        client_wants_usage,
        has_stream_options,
        prompt,
        prompt_tokens_est,
        max_tokens: raw
            .max_completion_tokens
            .or(raw.max_tokens)
            .or(raw.max_output_tokens),
        prompt_cache_key: raw.prompt_cache_key.map(Cow::into_owned),
        user: raw.user.map(Cow::into_owned),
        metadata_user_id: raw.metadata.and_then(|m| m.user_id).map(Cow::into_owned),
    })
}

/// Returns the body with `stream_options.include_usage: true` added, for a streaming request
/// on an API that takes `stream_options` and whose body has none. The insertion is textual
/// (right after the opening brace): everything the client sent stays byte-identical.
pub fn inject_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    const INS: &[u8] = br#""stream_options":{"include_usage":true},"#;
    let rest = &body[open + 1..];
    let rest_is_empty = rest
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + INS.len());
    out.extend_from_slice(&body[..=open]);
    if rest_is_empty {
        out.extend_from_slice(&INS[..INS.len() - 1]);
    } else {
        out.extend_from_slice(INS);
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// Returns the body with its top-level `model` replaced (a served name, an alias's service,
/// a route's target, the default model). The value is spliced in place: every other byte
/// stays as the client sent it, and nothing but the top level is built; a body whose model
/// cannot be found that way (no `model`, a duplicate key) takes a full JSON round trip.
pub fn rewrite_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Top<'a> {
        #[serde(borrow, default)]
        model: Option<&'a RawValue>,
    }
    if let Ok(Top { model: Some(raw) }) = serde_json::from_slice::<Top>(body) {
        let raw = raw.get().as_bytes();
        let at = (raw.as_ptr() as usize).checked_sub(body.as_ptr() as usize);
        if let Some(at) = at.filter(|&at| body.get(at..at + raw.len()) == Some(raw)) {
            let new = serde_json::to_vec(model).ok()?;
            let mut out = Vec::with_capacity(body.len() + new.len());
            out.extend_from_slice(&body[..at]);
            out.extend_from_slice(&new);
            out.extend_from_slice(&body[at + raw.len()..]);
            return Some(out);
        }
    }
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("model".into(), serde_json::Value::String(model.into()));
    serde_json::to_vec(&v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_renders_every_message_in_order() {
        let body = br#"{"model":"m","stream":true,"max_tokens":7,
            "tools":[{"type":"function","function":{"name":"f"}}],
            "messages":[{"role":"system","content":"be brief"},
                        {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]},
                        {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],
            "user":"u1","prompt_cache_key":"pk"}"#;
        let r = parse_request(Api::ChatCompletions, body).unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(7));
        assert!(
            r.prompt.starts_with("<|tools|>\n[{\"type\""),
            "{}",
            r.prompt
        );
        let sys = r.prompt.find("<|system|>\nbe brief\n").unwrap();
        let user = r.prompt.find("<|user|>\nhi there\n").unwrap();
        let asst = r.prompt.find("<|assistant|>\n[{\"id\":\"1\"}]").unwrap();
        assert!(sys < user && user < asst);
        assert_eq!(r.user.as_deref(), Some("u1"));
        assert_eq!(r.prompt_cache_key.as_deref(), Some("pk"));
        assert_eq!(r.prompt_tokens_est, r.prompt.len().div_ceil(4) as u64);
    }

    #[test]
    fn anthropic_system_and_metadata() {
        let body = br#"{"model":"claude","max_tokens":100,"system":[{"type":"text","text":"S"}],
            "metadata":{"user_id":"abc"},"messages":[{"role":"user","content":"q"}]}"#;
        let r = parse_request(Api::Messages, body).unwrap();
        assert_eq!(r.prompt, "<|system|>\nS\n<|user|>\nq\n");
        assert_eq!(r.metadata_user_id.as_deref(), Some("abc"));
        assert_eq!(r.max_tokens, Some(100));
    }

    #[test]
    fn responses_input_items_and_instructions() {
        let body = br#"{"model":"m","instructions":"I","input":[{"role":"user","content":"x"}],"max_output_tokens":5}"#;
        let r = parse_request(Api::Responses, body).unwrap();
        assert_eq!(r.prompt, "<|system|>\nI\n<|user|>\nx\n");
        assert_eq!(r.max_tokens, Some(5));
        let r = parse_request(Api::Responses, br#"{"model":"m","input":"plain"}"#).unwrap();
        assert_eq!(r.prompt, "plain");
    }

    #[test]
    fn escaped_strings_are_unescaped() {
        let r = parse_request(
            Api::Completions,
            br#"{"model":"m\u0031","prompt":"a\nb\"c"}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m1");
        assert_eq!(r.prompt, "a\nb\"c");
    }

    #[test]
    fn bad_bodies_are_client_errors() {
        for (body, want) in [
            (&b""[..], "empty"),
            (b"{", "invalid JSON"),
            (b"[1]", "invalid JSON"),
            (b"{\"messages\":[]}", "missing required field `model`"),
            (b"{\"model\":5}", "invalid JSON"),
            (b"{\"model\":\"m\",\"stream\":\"yes\"}", "invalid JSON"),
        ] {
            let e = parse_request(Api::ChatCompletions, body).unwrap_err();
            assert_eq!(e.status(), 400);
            assert!(e.to_string().contains(want), "{body:?}: {e}");
        }
    }

    #[test]
    fn include_usage_is_inserted_textually() {
        let out = inject_include_usage(b" {\"model\":\"m\"}").unwrap();
        assert_eq!(
            out,
            b" {\"stream_options\":{\"include_usage\":true},\"model\":\"m\"}"
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        let out = inject_include_usage(b"{ }").unwrap();
        assert!(serde_json::from_slice::<serde_json::Value>(&out).is_ok());
        assert!(inject_include_usage(b"[1]").is_none());
    }

    /// Random mutations (byte flips, truncations, insertions of JSON tokens) of valid bodies of
    /// every API: parsing never panics, and every error is a 400. Seeded: same cases each run.
    #[test]
    fn property_mutated_bodies_never_panic() {
        let seeds: [&[u8]; 4] = [
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":false},"max_tokens":7,"tools":[{"type":"function"}],"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],"user":"u","prompt_cache_key":"k"}"#,
            br#"{"model":"m","prompt":["a","b"],"max_tokens":3}"#,
            br#"{"model":"m","instructions":"i","input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}],"max_output_tokens":5}"#,
            br#"{"model":"claude","max_tokens":100,"system":[{"type":"text","text":"S"}],"metadata":{"user_id":"abc"},"messages":[{"role":"user","content":"q\u00e9\ud83d\ude00"}]}"#,
        ];
        const TOKENS: &[&[u8]] = &[
            b"{",
            b"}",
            b"[",
            b"]",
            b"\"",
            b"\\",
            b":",
            b",",
            b"null",
            b"1e999",
            b"-0",
            b"\"model\"",
            b"\"messages\"",
            b"\\ud800",
            b"\xff",
            b"\xc3",
            b"\x00",
            b" ",
        ];
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let apis = [
            Api::ChatCompletions,
            Api::Completions,
            Api::Responses,
            Api::Messages,
        ];
        for case in 0..20_000u32 {
            let mut b = seeds[case as usize % seeds.len()].to_vec();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % (b.len() + 1);
                match next() % 4 {
                    0 => b.truncate(at),
                    1 if at < b.len() => b[at] = next() as u8,
                    2 => {
                        let t = TOKENS[(next() as usize) % TOKENS.len()];
                        b.splice(at..at, t.iter().copied());
                    }
                    _ if at < b.len() => {
                        b.remove(at);
                    }
                    _ => {}
                }
            }
            let api = apis[(next() as usize) % apis.len()];
            match parse_request(api, &b) {
                Ok(info) => {
                    assert!(!info.model.is_empty());
                    assert_eq!(
                        info.prompt_tokens_est,
                        info.prompt.len().div_ceil(BYTES_PER_TOKEN) as u64
                    );
                }
                Err(e) => assert_eq!(e.status(), 400, "case {case}: {e}"),
            }
            // The body rewrites never panic either, and keep valid JSON valid.
            if let Some(out) = inject_include_usage(&b) {
                if serde_json::from_slice::<serde_json::Value>(&b).is_ok_and(|v| v.is_object()) {
                    assert!(serde_json::from_slice::<serde_json::Value>(&out).is_ok());
                }
            }
            let _ = rewrite_model(&b, "other");
        }
    }

    #[test]
    fn model_rewrite_keeps_the_rest() {
        let out = rewrite_model(br#"{"model":"x","n":1}"#, "y").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], "y");
        assert_eq!(v["n"], 1);
        // Spliced in place: the rest byte for byte, a nested `model` untouched.
        let body = br#"{ "z": {"model": "x"}, "model" : "x", "a":[1, 2] }"#;
        assert_eq!(
            rewrite_model(body, "Qwen/Q\"3").unwrap(),
            br#"{ "z": {"model": "x"}, "model" : "Qwen/Q\"3", "a":[1, 2] }"#
        );
        // No model: added by the round trip.
        let v: serde_json::Value =
            serde_json::from_slice(&rewrite_model(br#"{"n":1}"#, "y").unwrap()).unwrap();
        assert_eq!(v["model"], "y");
    }
}
