//! Token usage from upstream responses: the JSON body of a non-streaming response, or the
//! events of an SSE stream (OpenAI's final `usage` chunk, the Responses API's
//! `response.completed`, Anthropic's `message_start` / `message_delta`).
//!
//! [`SseScanner`] reads a stream as it passes without holding it back. When the gateway
//! injected `stream_options.include_usage` for a client that did not ask for it, the scanner
//! also removes the usage-only chunk (`"choices":[]`), so the client receives exactly what it
//! would have without the injection; in that mode bytes are released event by event.

use bytes::Bytes;
use memchr::memmem;
use serde_json::Value;

/// Token counts reported by the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt: Option<u64>,
    pub completion: Option<u64>,
    pub cached: Option<u64>,
}

impl Usage {
    fn merge(&mut self, o: Usage) {
        self.prompt = o.prompt.or(self.prompt);
        self.completion = o.completion.or(self.completion);
        self.cached = o.cached.or(self.cached);
    }

    pub fn is_empty(&self) -> bool {
        self.prompt.is_none() && self.completion.is_none() && self.cached.is_none()
    }
}

fn u(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

/// Reads one `usage` object in any of the three APIs' shapes.
fn usage_of(obj: &Value) -> Usage {
    let anth_read = u(obj, "cache_read_input_tokens");
    let anth_create = u(obj, "cache_creation_input_tokens");
    let prompt = u(obj, "prompt_tokens").or_else(|| {
        u(obj, "input_tokens").map(|i| i + anth_read.unwrap_or(0) + anth_create.unwrap_or(0))
    });
    let cached = obj
        .get("prompt_tokens_details")
        .or_else(|| obj.get("input_tokens_details"))
        .and_then(|d| u(d, "cached_tokens"))
        .or(anth_read);
    Usage {
        prompt,
        completion: u(obj, "completion_tokens").or_else(|| u(obj, "output_tokens")),
        cached,
    }
}

/// Finds `usage` at the top level or under `response` / `message` (Responses / Anthropic).
pub fn usage_in(v: &Value) -> Option<Usage> {
    [Some(v), v.get("response"), v.get("message")]
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("usage"))
        .find(|u| u.is_object())
        .map(usage_of)
}

/// Collects a non-streaming JSON response (up to a bound) and reads its usage at the end.
#[derive(Debug, Default)]
pub struct JsonCollector {
    buf: Vec<u8>,
    overflow: bool,
}

/// Largest non-streaming response body kept for usage parsing.
const JSON_LIMIT: usize = 8 * 1024 * 1024;

impl JsonCollector {
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow || self.buf.len() + chunk.len() > JSON_LIMIT {
            self.overflow = true;
            self.buf = Vec::new();
            return;
        }
        self.buf.extend_from_slice(chunk);
    }

    pub fn finish(&mut self) -> Option<Usage> {
        if self.overflow || self.buf.is_empty() {
            return None;
        }
        // Fast path: the engines put `usage` last; parse only that object.
        if let Some(pos) = memmem::rfind(&self.buf, b"\"usage\"") {
            let rest = &self.buf[pos + 7..];
            let colon = rest.iter().position(|b| !b.is_ascii_whitespace());
            if let Some(i) = colon.filter(|&i| rest[i] == b':') {
                let mut it =
                    serde_json::Deserializer::from_slice(&rest[i + 1..]).into_iter::<Value>();
                if let Some(Ok(obj)) = it.next() {
                    if obj.is_object() {
                        return Some(usage_of(&obj));
                    }
                }
            }
        }
        let v: Value = serde_json::from_slice(&self.buf).ok()?;
        usage_in(&v)
    }
}

/// Incremental SSE reader. See the module docs.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// Bytes of the current, incomplete line (pass-through mode) or event (strip mode).
    pending: Vec<u8>,
    /// Start of the current line inside `pending` (strip mode).
    line_start: usize,
    /// Remove usage-only chunks from what the client receives.
    strip_usage_chunk: bool,
    /// The current event is a usage-only chunk (strip mode).
    drop_event: bool,
    pub usage: Usage,
    /// `data: [DONE]` or a terminal event was seen.
    pub done: bool,
    /// Count of `data:` lines seen.
    pub data_events: u64,
}

impl SseScanner {
    pub fn new(strip_usage_chunk: bool) -> Self {
        SseScanner {
            strip_usage_chunk,
            ..Default::default()
        }
    }

    /// Reads a chunk. Returns `None` when the chunk passes unchanged, or the bytes to send
    /// instead (strip mode).
    pub fn feed(&mut self, chunk: &[u8]) -> Option<Bytes> {
        if !self.strip_usage_chunk {
            self.scan_passthrough(chunk);
            return None;
        }
        let mut out = Vec::with_capacity(chunk.len());
        for &b in chunk {
            self.pending.push(b);
            if b == b'\n' {
                let line_end = self.pending.len();
                let line = trim_eol(&self.pending[self.line_start..line_end]);
                if line.is_empty() {
                    // End of event: release it unless it is the usage-only chunk.
                    if !self.drop_event {
                        out.extend_from_slice(&self.pending);
                    }
                    self.pending.clear();
                    self.line_start = 0;
                    self.drop_event = false;
                } else {
                    let line = line.to_vec();
                    if self.on_line(&line) {
                        self.drop_event = true;
                    }
                    self.line_start = line_end;
                }
            }
        }
        Some(Bytes::from(out))
    }

    /// End of stream: whatever is still pending (an unterminated last event) is released.
    pub fn finish(&mut self) -> Option<Bytes> {
        if self.strip_usage_chunk {
            let rest = std::mem::take(&mut self.pending);
            if !rest.is_empty() && !self.drop_event {
                return Some(Bytes::from(rest));
            }
            return Some(Bytes::new());
        }
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.on_line(trim_eol(&line));
        }
        None
    }

    fn scan_passthrough(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some(nl) = memchr::memchr(b'\n', rest) {
            if self.pending.is_empty() {
                self.on_line(trim_eol(&rest[..nl]));
            } else {
                self.pending.extend_from_slice(&rest[..nl]);
                let line = std::mem::take(&mut self.pending);
                self.on_line(trim_eol(&line));
            }
            rest = &rest[nl + 1..];
        }
        if !rest.is_empty() {
            if self.pending.len() + rest.len() > JSON_LIMIT {
                self.pending.clear(); // a runaway line: give up on it
            } else {
                self.pending.extend_from_slice(rest);
            }
        }
    }

    /// Reads one line; returns true when it is a usage-only chunk (no choices).
    fn on_line(&mut self, line: &[u8]) -> bool {
        let Some(data) = line.strip_prefix(b"data:") else {
            if line.starts_with(b"event: message_stop")
                || line.starts_with(b"event: response.completed")
                || line.starts_with(b"event: response.incomplete")
                || line.starts_with(b"event: response.failed")
            {
                self.done = true;
            }
            return false;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        self.data_events += 1;
        if data == b"[DONE]" {
            self.done = true;
            return false;
        }
        if memmem::find(data, b"\"usage\"").is_none() {
            return false;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return false;
        };
        let Some(usage) = usage_in(&v) else {
            return false;
        };
        self.usage.merge(usage);
        matches!(v.get("choices"), Some(Value::Array(a)) if a.is_empty())
    }
}

fn trim_eol(l: &[u8]) -> &[u8] {
    let l = l.strip_suffix(b"\n").unwrap_or(l);
    l.strip_suffix(b"\r").unwrap_or(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENAI: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n\
data: [DONE]\n\n";

    #[test]
    fn passthrough_reads_usage_across_any_split() {
        for split in 1..OPENAI.len() {
            let mut s = SseScanner::new(false);
            assert!(s.feed(&OPENAI.as_bytes()[..split]).is_none());
            assert!(s.feed(&OPENAI.as_bytes()[split..]).is_none());
            s.finish();
            assert_eq!(
                s.usage,
                Usage {
                    prompt: Some(10),
                    completion: Some(2),
                    cached: Some(8)
                },
                "split {split}"
            );
            assert!(s.done);
        }
    }

    #[test]
    fn strip_mode_removes_only_the_usage_chunk() {
        for split in 1..OPENAI.len() {
            let mut s = SseScanner::new(true);
            let mut out = Vec::new();
            out.extend_from_slice(&s.feed(&OPENAI.as_bytes()[..split]).unwrap());
            out.extend_from_slice(&s.feed(&OPENAI.as_bytes()[split..]).unwrap());
            out.extend_from_slice(&s.finish().unwrap());
            assert_eq!(
                String::from_utf8(out).unwrap(),
                "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n"
            );
            assert_eq!(s.usage.cached, Some(8));
        }
    }

    #[test]
    fn anthropic_and_responses_shapes() {
        let a = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"cache_read_input_tokens\":16,\"output_tokens\":1}}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let mut s = SseScanner::new(false);
        s.feed(a.as_bytes());
        assert_eq!(
            s.usage,
            Usage {
                prompt: Some(19),
                completion: Some(9),
                cached: Some(16)
            }
        );
        assert!(s.done);
        let r = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":4,\"input_tokens_details\":{\"cached_tokens\":0}}}}\n\n";
        let mut s = SseScanner::new(false);
        s.feed(r.as_bytes());
        assert_eq!(s.usage.prompt, Some(5));
        assert_eq!(s.usage.cached, Some(0));
    }

    #[test]
    fn json_usage_fast_path_and_fallback() {
        let mut c = JsonCollector::default();
        c.feed(br#"{"choices":[{"message":{"content":"the word \"usage\" here"}}],"usage" : {"prompt_tokens":9,"completion_tokens":2}}"#);
        assert_eq!(c.finish().unwrap().prompt, Some(9));
        let mut c = JsonCollector::default();
        c.feed(br#"{"usage":{"input_tokens":3,"output_tokens":1},"content":[{"text":"usage"}]}"#);
        assert_eq!(c.finish().unwrap().prompt, Some(3));
    }

    #[test]
    fn json_body_usage() {
        let mut c = JsonCollector::default();
        c.feed(b"{\"usage\":{\"prompt_tokens\":4,");
        c.feed(b"\"completion_tokens\":1}}");
        assert_eq!(c.finish().unwrap().completion, Some(1));
    }
}
