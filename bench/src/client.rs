//! Sending one streaming chat completion and timing it from the client's side.
//!
//! The response is read chunk by chunk as it arrives and fed to an incremental SSE parser
//! ([`SseParser`]); every event that carries non-empty content is a *content chunk* stamped
//! with the arrival time of the network read that completed it. TTFT = first content chunk −
//! send; inter-token latency = gap between consecutive content chunks (chunks that arrive in
//! one read have a gap of 0: that is what the client saw); end-to-end = end of stream − send.
//! `usage` (prompt, completion and `prompt_tokens_details.cached_tokens`) is read from the
//! final chunk (`stream_options.include_usage: true`). The instance that served the request
//! is read from `x-tokengate-instance`, else `x-engine-id`.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Deserialize;

use super::report::RequestRecord;

/// Response headers naming the instance, in order of preference.
pub const INSTANCE_HEADERS: [&str; 2] = ["x-tokengate-instance", "x-engine-id"];

/// Incremental Server-Sent-Events parser: feed bytes as they arrive, get each event's data.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: String,
    has_data: bool,
}

impl SseParser {
    /// Feeds `bytes`; calls `on_event(data)` for each complete event that had `data:` lines
    /// (several `data:` lines are joined with `\n`). Accepts LF and CRLF line ends.
    pub fn push(&mut self, mut bytes: &[u8], mut on_event: impl FnMut(&str)) {
        while let Some(nl) = memchr::memchr(b'\n', bytes) {
            let (head, rest) = bytes.split_at(nl);
            bytes = &rest[1..];
            let line: &[u8] = if self.line.is_empty() {
                head
            } else {
                self.line.extend_from_slice(head);
                &self.line
            };
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                if self.has_data {
                    on_event(&self.data);
                }
                self.data.clear();
                self.has_data = false;
            } else if let Some(v) = line.strip_prefix(b"data:") {
                let v = v.strip_prefix(b" ").unwrap_or(v);
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&String::from_utf8_lossy(v));
                self.has_data = true;
            }
            self.line.clear();
        }
        self.line.extend_from_slice(bytes);
    }
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    /// `/v1/completions` chunks carry `text` instead of `delta.content`.
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// What to send.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// Full URL of the chat completions endpoint.
    pub endpoint: String,
    /// Request body (already JSON).
    pub body: String,
    pub max_tokens: usize,
    /// (header name, session id).
    pub session: Option<(String, String)>,
    pub api_key: Option<String>,
    pub timeout: Duration,
    /// Keep the streamed text (the synthetic workload appends it to the history).
    pub keep_text: bool,
}

/// Result of one request: its record, its inter-token gaps (ms) and, if asked, its text.
#[derive(Debug, Default)]
pub struct Sent {
    pub record: RequestRecord,
    pub itl_ms: Vec<f64>,
    pub text: String,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Sends `out`, streaming. `record` comes pre-filled with the request's identity; `t0` is the
/// run's start (record times are offsets from it).
pub async fn send(
    client: &reqwest::Client,
    out: Outgoing,
    mut record: RequestRecord,
    t0: Instant,
) -> Sent {
    let sent_at = Instant::now();
    record.sent_ms = ms(sent_at - t0);
    let mut res = Sent::default();
    let timeout = out.timeout;
    let fut = exchange(client, &out, &mut record, &mut res, sent_at);
    if tokio::time::timeout(timeout, fut).await.is_err() {
        record.error = Some("timeout".into());
    }
    let end = Instant::now();
    record.end_ms = ms(end - t0);
    record.e2e_ms = Some(ms(end - sent_at));
    res.record = record;
    res
}

async fn exchange(
    client: &reqwest::Client,
    out: &Outgoing,
    rec: &mut RequestRecord,
    res: &mut Sent,
    sent_at: Instant,
) {
    let mut req = client
        .post(&out.endpoint)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("x-sim-output-tokens", out.max_tokens.to_string())
        .body(out.body.clone());
    if let Some((name, value)) = &out.session {
        req = req.header(name.as_str(), value.as_str());
    }
    if let Some(key) = &out.api_key {
        req = req.bearer_auth(key);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            rec.error = Some(transport_kind(&e).into());
            rec.error_detail = Some(format!("{e:#}"));
            return;
        }
    };
    let status = resp.status().as_u16();
    rec.status = Some(status);
    rec.instance = INSTANCE_HEADERS
        .iter()
        .find_map(|h| resp.headers().get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if status != 200 {
        rec.error = Some(format!("http_{status}"));
        let body = resp.bytes().await.unwrap_or_default();
        let cut = body.len().min(300);
        rec.error_detail = Some(String::from_utf8_lossy(&body[..cut]).into_owned());
        return;
    }
    let mut parser = SseParser::default();
    let mut stream = resp.bytes_stream();
    let mut last_chunk: Option<Instant> = None;
    let mut done = false;
    let mut stream_error: Option<String> = None;
    while let Some(item) = stream.next().await {
        let bytes = match item {
            Ok(b) => b,
            Err(e) => {
                rec.error = Some(
                    if e.is_timeout() {
                        "timeout"
                    } else {
                        "stream_broken"
                    }
                    .into(),
                );
                rec.error_detail = Some(format!("{e:#}"));
                return;
            }
        };
        let now = Instant::now();
        parser.push(&bytes, |data| {
            if data == "[DONE]" {
                done = true;
                return;
            }
            let Ok(chunk) = serde_json::from_str::<Chunk>(data) else {
                stream_error.get_or_insert_with(|| format!("unparsable event: {data:.200}"));
                return;
            };
            if let Some(e) = chunk.error {
                stream_error.get_or_insert_with(|| format!("{e:.200}"));
            }
            let content = chunk.choices.first().and_then(|c| {
                c.delta
                    .as_ref()
                    .and_then(|d| d.content.as_deref())
                    .or(c.text.as_deref())
            });
            if let Some(text) = content.filter(|t| !t.is_empty()) {
                match last_chunk {
                    None => rec.ttft_ms = Some(ms(now - sent_at)),
                    Some(prev) => res.itl_ms.push(ms(now - prev)),
                }
                last_chunk = Some(now);
                rec.content_chunks += 1;
                if out.keep_text {
                    res.text.push_str(text);
                }
            }
            if let Some(u) = chunk.usage {
                rec.prompt_tokens = u.prompt_tokens;
                rec.completion_tokens = u.completion_tokens;
                rec.cached_tokens = u.prompt_tokens_details.and_then(|d| d.cached_tokens);
            }
        });
    }
    if let Some(e) = stream_error {
        rec.error = Some("stream_error".into());
        rec.error_detail = Some(e);
    } else if !done {
        rec.error = Some("incomplete".into());
        rec.error_detail = Some("stream ended without [DONE]".into());
    }
}

fn transport_kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else {
        "transport"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(parts: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for part in parts {
            p.push(part, |d| out.push(d.to_string()));
        }
        out
    }

    #[test]
    fn sse_events_split_anywhere() {
        let whole = b"data: {\"a\":1}\n\n: comment\nevent: x\ndata: [DONE]\n\n";
        let expect = vec!["{\"a\":1}".to_string(), "[DONE]".to_string()];
        assert_eq!(events(&[whole]), expect);
        for cut in 0..whole.len() {
            assert_eq!(events(&[&whole[..cut], &whole[cut..]]), expect, "cut {cut}");
        }
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(events(&bytes), expect);
    }

    #[test]
    fn sse_crlf_multiline_and_incomplete_tail() {
        assert_eq!(
            events(&[b"data: a\r\ndata: b\r\n\r\ndata:c\n\ndata: partial"]),
            vec!["a\nb".to_string(), "c".to_string()]
        );
    }

    #[test]
    fn chunk_shapes_parse() {
        let c: Chunk = serde_json::from_str(
            r#"{"id":"x","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#,
        )
        .unwrap();
        let u = c.usage.unwrap();
        assert_eq!(u.prompt_tokens, Some(10));
        assert_eq!(u.prompt_tokens_details.unwrap().cached_tokens, Some(8));
        let c: Chunk = serde_json::from_str(
            r#"{"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}"#,
        )
        .unwrap();
        assert_eq!(
            c.choices[0].delta.as_ref().unwrap().content.as_deref(),
            Some("hi")
        );
        assert!(c.usage.is_none());
    }
}
