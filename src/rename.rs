//! The answer's `model` renamed back to the name the client sent (a service's `model`
//! apart from its `name`, or an alias): every `"model": "<served>"` pair of a JSON body or
//! of an SSE stream's events, at any depth (Anthropic's `message_start` has it under
//! `message`, the Responses API's events under `response`), rewritten as the bytes pass.
//!
//! The rewrite is textual: a `"model"` key is a JSON token (inside a string its quotes are
//! escaped), so no parse of the body is needed. A pair cut by a chunk boundary is held back
//! until the next chunk completes it; an SSE event ends with a blank line, so a stream's
//! events are never held.

use bytes::Bytes;
use memchr::memmem;

const KEY: &[u8] = b"\"model\"";

/// Rewrites `"model": "<from>"` to `"model": "<to>"` in a body fed chunk by chunk.
#[derive(Debug)]
pub struct Rename {
    /// `from` and `to` as JSON strings, quotes included.
    from: Vec<u8>,
    to: Vec<u8>,
    /// The end of the last chunk, held back: it may be the start of a pair.
    carry: Vec<u8>,
}

/// Where the scan of a buffer stopped.
enum Scan {
    /// Everything up to the end was seen.
    Done,
    /// A pair may start at this offset and go on in the next chunk.
    Partial(usize),
}

impl Rename {
    /// `None` when the names are the same (nothing to rename).
    pub fn new(from: &str, to: &str) -> Option<Rename> {
        if from == to {
            return None;
        }
        Some(Rename {
            from: serde_json::to_vec(from).ok()?,
            to: serde_json::to_vec(to).ok()?,
            carry: Vec::new(),
        })
    }

    /// The bytes to pass on for the next `chunk`; `None`: `chunk` as it is.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<Bytes> {
        if self.carry.is_empty() && memmem::find(chunk, b"\"m").is_none() && !ends_in_key(chunk) {
            return None;
        }
        let carried = !self.carry.is_empty();
        let joined;
        let buf: &[u8] = if carried {
            joined = [std::mem::take(&mut self.carry).as_slice(), chunk].concat();
            &joined
        } else {
            chunk
        };
        let mut out = Vec::new();
        let mut from = 0;
        let keep = match self.scan(buf, &mut out, &mut from) {
            Scan::Partial(at) => at,
            Scan::Done => buf.len() - ends_in_key_len(&buf[from..]),
        };
        if !carried && from == 0 && keep == buf.len() {
            return None; // nothing renamed, nothing held back
        }
        out.extend_from_slice(&buf[from..keep]);
        self.carry = buf[keep..].to_vec();
        Some(Bytes::from(out))
    }

    /// The bytes held back at the end of the body.
    pub fn finish(&mut self) -> Option<Bytes> {
        (!self.carry.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.carry)))
    }

    /// Copies `buf` into `out` from `*from`, the pairs renamed, up to the last pair
    /// found (`*from` then points after it) or to a pair that the buffer cuts.
    fn scan(&self, buf: &[u8], out: &mut Vec<u8>, from: &mut usize) -> Scan {
        let finder = memmem::Finder::new(KEY);
        let mut at = *from;
        while let Some(i) = finder.find(&buf[at..]).map(|i| i + at) {
            at = i + 1;
            if i > 0 && buf[i - 1] == b'\\' {
                continue;
            }
            let mut j = skip_ws(buf, i + KEY.len());
            match buf.get(j) {
                None => return Scan::Partial(i),
                Some(b':') => {}
                Some(_) => continue,
            }
            j = skip_ws(buf, j + 1);
            let rest = &buf[j..];
            if rest.len() < self.from.len() {
                if self.from.starts_with(rest) {
                    return Scan::Partial(i);
                }
                continue;
            }
            if rest.starts_with(&self.from) {
                out.extend_from_slice(&buf[*from..j]);
                out.extend_from_slice(&self.to);
                *from = j + self.from.len();
                at = *from;
            }
        }
        Scan::Done
    }
}

fn skip_ws(buf: &[u8], mut j: usize) -> usize {
    while buf.get(j).is_some_and(u8::is_ascii_whitespace) {
        j += 1;
    }
    j
}

/// How many bytes at the end of `buf` are a proper start of `"model"`.
fn ends_in_key_len(buf: &[u8]) -> usize {
    (1..KEY.len())
        .rev()
        .find(|&k| buf.ends_with(&KEY[..k]))
        .unwrap_or(0)
}

fn ends_in_key(buf: &[u8]) -> bool {
    ends_in_key_len(buf) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `body` cut into pieces of `n` bytes; the whole output.
    fn run(r: &mut Rename, body: &[u8], n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in body.chunks(n) {
            match r.feed(c) {
                Some(b) => out.extend_from_slice(&b),
                None => out.extend_from_slice(c),
            }
        }
        if let Some(b) = r.finish() {
            out.extend_from_slice(&b);
        }
        out
    }

    #[test]
    fn every_pair_at_any_depth_whatever_the_cuts() {
        let body = br#"data: {"type":"message_start","message":{"model" : "Qwen/Qwen3-8B","x":"\"model\":\"Qwen/Qwen3-8B\""}}

data: {"model":"Qwen/Qwen3-8B","choices":[{"text":"model"}],"other_model":"Qwen/Qwen3-8B","model":"Qwen/Qwen3-8Bx"}

"#;
        let want = br#"data: {"type":"message_start","message":{"model" : "qwen3-8b","x":"\"model\":\"Qwen/Qwen3-8B\""}}

data: {"model":"qwen3-8b","choices":[{"text":"model"}],"other_model":"Qwen/Qwen3-8B","model":"Qwen/Qwen3-8Bx"}

"#;
        for n in 1..=body.len() {
            let mut r = Rename::new("Qwen/Qwen3-8B", "qwen3-8b").unwrap();
            let out = run(&mut r, body, n);
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(want),
                "chunks of {n}"
            );
        }
    }

    #[test]
    fn untouched_chunks_are_not_copied() {
        let mut r = Rename::new("a", "b").unwrap();
        assert!(r.feed(b"{\"id\":1,\"text\":\"hello\"}").is_none());
        assert!(Rename::new("same", "same").is_none());
        // A chunk ending in the start of the key is held back, then completed.
        assert_eq!(r.feed(b"{\"mo").as_deref(), Some(&b"{"[..]));
        assert_eq!(
            r.feed(b"del\":\"a\"}").as_deref(),
            Some(&b"\"model\":\"b\"}"[..])
        );
        assert!(r.finish().is_none());
    }
}
