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

/// `"usage"`, searched for in every response; the searchers are built once.
static USAGE_KEY: once_cell::sync::Lazy<memmem::Finder<'static>> =
    once_cell::sync::Lazy::new(|| memmem::Finder::new(b"\"usage\""));
static USAGE_KEY_REV: once_cell::sync::Lazy<memmem::FinderRev<'static>> =
    once_cell::sync::Lazy::new(|| memmem::FinderRev::new(b"\"usage\""));

/// A `usage` object in any of the three APIs' shapes, read without building a `Value`
/// (the hot path of every non-streaming response). Same rules as [`usage_of`].
#[derive(serde::Deserialize)]
struct TypedUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    prompt_tokens_details: Option<TypedDetails>,
    input_tokens_details: Option<TypedDetails>,
}

#[derive(serde::Deserialize)]
struct TypedDetails {
    cached_tokens: Option<u64>,
}

impl From<TypedUsage> for Usage {
    fn from(t: TypedUsage) -> Usage {
        let anth_read = t.cache_read_input_tokens;
        let prompt = t.prompt_tokens.or_else(|| {
            t.input_tokens.map(|i| {
                i.saturating_add(anth_read.unwrap_or(0))
                    .saturating_add(t.cache_creation_input_tokens.unwrap_or(0))
            })
        });
        let cached = t
            .prompt_tokens_details
            .or(t.input_tokens_details)
            .and_then(|d| d.cached_tokens)
            .or(anth_read);
        Usage {
            prompt,
            completion: t.completion_tokens.or(t.output_tokens),
            cached,
        }
    }
}

/// Reads one `usage` object in any of the three APIs' shapes.
fn usage_of(obj: &Value) -> Usage {
    let anth_read = u(obj, "cache_read_input_tokens");
    let anth_create = u(obj, "cache_creation_input_tokens");
    let prompt = u(obj, "prompt_tokens").or_else(|| {
        u(obj, "input_tokens").map(|i| {
            i.saturating_add(anth_read.unwrap_or(0))
                .saturating_add(anth_create.unwrap_or(0))
        })
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
        if let Some(pos) = USAGE_KEY_REV.rfind(&self.buf) {
            let rest = &self.buf[pos + 7..];
            let colon = rest.iter().position(|b| !b.is_ascii_whitespace());
            if let Some(i) = colon.filter(|&i| rest[i] == b':') {
                let mut typed =
                    serde_json::Deserializer::from_slice(&rest[i + 1..]).into_iter::<TypedUsage>();
                if let Some(Ok(t)) = typed.next() {
                    return Some(t.into());
                }
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

/// Largest event held back in strip mode. An event that grows beyond it (a malformed stream
/// without blank lines, a huge event) is released and passed through, so a broken engine
/// cannot make the gateway buffer a whole response or delay its first byte.
const HOLD_LIMIT: usize = 64 * 1024;

/// Incremental SSE reader. See the module docs.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// Bytes of the current, incomplete line (pass-through mode) or held event (strip mode).
    pending: Vec<u8>,
    /// The current line (strip mode), for parsing.
    line: Vec<u8>,
    /// The current line outgrew the parsing limit and is skipped (strip mode).
    line_overflow: bool,
    /// Remove usage-only chunks from what the client receives.
    strip_usage_chunk: bool,
    /// The current event is a usage-only chunk (strip mode).
    drop_event: bool,
    /// The current event was released early (over [`HOLD_LIMIT`]); its remaining bytes pass
    /// through as they come (strip mode).
    passing: bool,
    pub usage: Usage,
    /// `data: [DONE]` or a terminal event was seen.
    pub done: bool,
    /// Count of `data:` lines seen.
    pub data_events: u64,
    /// A `data:` event carrying generated output was seen ([`carries_token`]): the end of
    /// the prefill phase. Events sent before (the Responses API's `response.created`, a chat
    /// stream's role-only first chunk, Anthropic's `message_start`, comments) do not count.
    pub first_token: bool,
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
            if self.passing {
                out.push(b);
            } else if !self.drop_event {
                self.pending.push(b);
            }
            if self.line.len() < JSON_LIMIT {
                self.line.push(b);
            } else {
                self.line_overflow = true;
            }
            if b == b'\n' {
                let line = std::mem::take(&mut self.line);
                let l = trim_eol(&line);
                if l.is_empty() {
                    // End of event: release it unless it is the usage-only chunk.
                    if !self.passing && !self.drop_event {
                        out.extend_from_slice(&self.pending);
                    }
                    self.pending.clear();
                    self.drop_event = false;
                    self.passing = false;
                } else if !std::mem::take(&mut self.line_overflow)
                    && self.on_line(l)
                    && !self.passing
                {
                    self.drop_event = true;
                    self.pending.clear();
                }
                self.line = line;
                self.line.clear();
            } else if !self.passing && !self.drop_event && self.pending.len() > HOLD_LIMIT {
                out.append(&mut self.pending);
                self.passing = true;
            }
        }
        Some(Bytes::from(out))
    }

    /// End of stream: whatever is still pending (an unterminated last event) is released.
    pub fn finish(&mut self) -> Option<Bytes> {
        if self.strip_usage_chunk {
            // An unterminated last line is still read for usage.
            let line = std::mem::take(&mut self.line);
            let l = trim_eol(&line);
            if !l.is_empty()
                && !std::mem::take(&mut self.line_overflow)
                && self.on_line(l)
                && !self.passing
            {
                self.drop_event = true;
            }
            let rest = std::mem::take(&mut self.pending);
            if !rest.is_empty() && !self.drop_event && !self.passing {
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
        if !self.first_token && carries_token(data) {
            self.first_token = true;
        }
        if USAGE_KEY.find(data).is_none() {
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

static DELTA_TYPE: once_cell::sync::Lazy<memmem::Finder<'static>> =
    once_cell::sync::Lazy::new(|| memmem::Finder::new(b".delta\""));
static CONTENT_BLOCK_DELTA: once_cell::sync::Lazy<memmem::Finder<'static>> =
    once_cell::sync::Lazy::new(|| memmem::Finder::new(b"\"content_block_delta\""));
static TOOL_CALLS: once_cell::sync::Lazy<memmem::Finder<'static>> =
    once_cell::sync::Lazy::new(|| memmem::Finder::new(b"\"tool_calls\":[{"));
/// Keys whose non-empty string value is generated output (chat, completions, reasoning).
static OUTPUT_KEYS: once_cell::sync::Lazy<[memmem::Finder<'static>; 4]> =
    once_cell::sync::Lazy::new(|| {
        [
            memmem::Finder::new(b"\"content\":\""),
            memmem::Finder::new(b"\"text\":\""),
            memmem::Finder::new(b"\"reasoning_content\":\""),
            memmem::Finder::new(b"\"reasoning\":\""),
        ]
    });

/// Whether an SSE `data:` payload carries generated output (the first token): an OpenAI chat
/// or completions chunk with non-empty `content` / `text` / reasoning or a tool call, an
/// Anthropic `content_block_delta`, or a Responses API `*.delta` event. Substring checks on
/// the raw bytes, no JSON parse: this runs on every event until the first token.
pub fn carries_token(data: &[u8]) -> bool {
    if CONTENT_BLOCK_DELTA.find(data).is_some()
        || DELTA_TYPE.find(data).is_some()
        || TOOL_CALLS.find(data).is_some()
    {
        return true;
    }
    OUTPUT_KEYS.iter().any(|f| {
        f.find_iter(data)
            .any(|i| data.get(i + f.needle().len()).is_some_and(|&b| b != b'"'))
    })
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

    /// A tiny deterministic RNG for the property tests (no dependency, same cases every run).
    pub(crate) struct XorShift(pub u64);
    impl XorShift {
        pub(super) fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
        pub(super) fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A random SSE-ish stream: well-formed events, usage chunks, comments, CRLF, broken JSON,
    /// missing blank lines and raw garbage bytes.
    fn random_stream(r: &mut XorShift) -> Vec<u8> {
        const PIECES: &[&[u8]] = &[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
            b"data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"prompt_tokens\":4}}\n\n",
            b"data: [DONE]\n\n",
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            b": keep-alive\n\n",
            b"data: {\"usage\": {\"prompt_tokens\": \"NaN\"\n\n",
            b"data: {broken\r\n\r\n",
            b"data:{\"usage\":{\"input_tokens\":1}}\r\n",
            b"\n",
            b"\r",
            b"data: ",
            b"\"usage\"",
        ];
        let mut v = Vec::new();
        for _ in 0..r.below(40) {
            if r.below(5) == 0 {
                for _ in 0..r.below(64) {
                    v.push(r.next() as u8);
                }
            } else {
                v.extend_from_slice(PIECES[r.below(PIECES.len())]);
            }
        }
        v
    }

    /// Feeds `input` in random pieces; returns (what the client receives, the scanner).
    fn run(input: &[u8], strip: bool, r: &mut XorShift) -> (Vec<u8>, SseScanner) {
        let mut s = SseScanner::new(strip);
        let mut out = Vec::new();
        let mut rest = input;
        while !rest.is_empty() {
            let n = 1 + r.below(rest.len().min(50));
            let (a, b) = rest.split_at(n);
            match s.feed(a) {
                Some(x) => out.extend_from_slice(&x),
                None => out.extend_from_slice(a),
            }
            rest = b;
        }
        if let Some(x) = s.finish() {
            out.extend_from_slice(&x);
        }
        (out, s)
    }

    fn is_subsequence(small: &[u8], big: &[u8]) -> bool {
        let mut it = big.iter();
        small.iter().all(|c| it.any(|b| b == c))
    }

    #[test]
    fn property_random_streams_and_splits() {
        let mut r = XorShift(0x9e37_79b9_7f4a_7c15);
        for case in 0..3000 {
            let input = random_stream(&mut r);
            let (whole, whole_s) = run(&input, false, &mut XorShift(1));
            // Pass-through mode never changes a byte, whatever the split.
            let (split, split_s) = run(&input, false, &mut r);
            assert_eq!(whole, input, "case {case}");
            assert_eq!(split, input, "case {case}");
            assert_eq!(whole_s.usage, split_s.usage, "case {case}");
            assert_eq!(whole_s.done, split_s.done, "case {case}");
            // Strip mode: the same output and usage for any split, only whole events
            // removed (a subsequence), nothing removed when there is no usage at all.
            let (a, sa) = run(&input, true, &mut r);
            let (b, sb) = run(&input, true, &mut r);
            assert_eq!(a, b, "case {case}");
            assert_eq!(sa.usage, whole_s.usage, "case {case}");
            assert_eq!(sb.done, whole_s.done, "case {case}");
            assert!(is_subsequence(&a, &input), "case {case}");
            if memmem::find(&input, b"usage").is_none() {
                assert_eq!(a, input, "case {case}");
            }
        }
    }

    #[test]
    fn strip_mode_does_not_hold_a_stream_without_blank_lines() {
        let mut s = SseScanner::new(true);
        let line = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n";
        let mut released = 0usize;
        let mut fed = 0usize;
        for _ in 0..10_000 {
            released += s.feed(line).unwrap().len();
            fed += line.len();
        }
        // At most one held event's worth is still pending.
        assert!(
            fed - released <= HOLD_LIMIT + line.len(),
            "{fed} {released}"
        );
        released += s.finish().unwrap().len();
        assert_eq!(released, fed);
    }

    #[test]
    fn typed_usage_agrees_with_value_reading() {
        for u in [
            r#"{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}"#,
            r#"{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":null}"#,
            r#"{"input_tokens":3,"output_tokens":1,"input_tokens_details":{"cached_tokens":2}}"#,
            r#"{"input_tokens":3,"output_tokens":1,"cache_read_input_tokens":5,"cache_creation_input_tokens":7}"#,
            r#"{"completion_tokens":1}"#,
            r#"{"input_tokens":18446744073709551615,"cache_read_input_tokens":5}"#,
            r#"{}"#,
        ] {
            let typed: TypedUsage = serde_json::from_str(u).unwrap();
            let v: Value = serde_json::from_str(u).unwrap();
            assert_eq!(Usage::from(typed), usage_of(&v), "{u}");
        }
        // Not the typed shape: the Value reading still answers.
        let mut c = JsonCollector::default();
        c.feed(br#"{"usage":{"prompt_tokens":1.0,"completion_tokens":2}}"#);
        assert_eq!(c.finish().unwrap().completion, Some(2));
    }

    #[test]
    fn json_body_usage() {
        let mut c = JsonCollector::default();
        c.feed(b"{\"usage\":{\"prompt_tokens\":4,");
        c.feed(b"\"completion_tokens\":1}}");
        assert_eq!(c.finish().unwrap().completion, Some(1));
    }

    #[test]
    fn the_first_token_is_the_first_event_with_output() {
        for (data, token) in [
            (&br#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#[..], false),
            (br#"{"choices":[{"delta":{"content":"Hi"}}]}"#, true),
            (br#"{"choices":[{"text":"","index":0}]}"#, false),
            (br#"{"choices":[{"text":" a","index":0}]}"#, true),
            (br#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#, true),
            (br#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c"}]}}]}"#, true),
            (br#"{"type":"message_start","message":{"content":[]}}"#, false),
            (br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#, false),
            (br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#, true),
            (br#"{"type":"response.created","response":{"status":"in_progress"}}"#, false),
            (br#"{"type":"response.output_text.delta","delta":"x"}"#, true),
        ] {
            assert_eq!(carries_token(data), token, "{}", String::from_utf8_lossy(data));
        }
        let mut s = SseScanner::new(false);
        s.feed(b": keep-alive\n\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n");
        assert!(!s.first_token);
        s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"H");
        assert!(!s.first_token, "an unfinished line is not read yet");
        s.feed(b"i\"}}]}\n\n");
        assert!(s.first_token);
    }
}
