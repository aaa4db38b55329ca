//! Mooncake-format traces: parsing, block-size scaling, session roots, prefix-hit ceiling.
//!
//! One JSON object per line: `timestamp` (ms since the trace start), `input_length` and
//! `output_length` (tokens), `hash_ids` (one id per block of `trace_block_tokens` = 512
//! tokens; equal ids = the same prefix content, so a later request whose leading ids were
//! seen before can reuse that KV cache).

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// Tokens per hash-id block in the Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One trace line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, ms since the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// One id per prompt block; the last block may be partial.
    pub hash_ids: Vec<u64>,
}

/// Parses JSONL text (blank lines are skipped); errors name the line.
pub fn parse_trace(text: &str) -> anyhow::Result<Vec<TraceRecord>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r: TraceRecord =
            serde_json::from_str(line).with_context(|| format!("trace line {}", i + 1))?;
        if r.hash_ids.is_empty() && r.input_length > 0 {
            bail!("trace line {}: input_length > 0 but no hash_ids", i + 1);
        }
        out.push(r);
    }
    Ok(out)
}

/// Reads and parses a trace file.
pub fn load_trace(path: &Path) -> anyhow::Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading trace {}", path.display()))?;
    parse_trace(&text).with_context(|| format!("parsing trace {}", path.display()))
}

/// How trace records become requests.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Scaling {
    /// Tokens per block in the trace (512 for Mooncake).
    pub trace_block_tokens: usize,
    /// Tokens per block when replayed; every token count is scaled by
    /// `block_tokens / trace_block_tokens`.
    pub block_tokens: usize,
    /// Trace time is divided by this (10 = ten times faster).
    pub time_scale: f64,
}

impl Default for Scaling {
    fn default() -> Self {
        Scaling {
            trace_block_tokens: MOONCAKE_BLOCK_TOKENS,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            time_scale: 1.0,
        }
    }
}

/// A trace record after scaling: what is actually sent.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaledRequest {
    /// Send time since the start of the replay.
    pub at: Duration,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub hash_ids: Vec<u64>,
}

impl Scaling {
    fn factor(&self) -> f64 {
        self.block_tokens as f64 / self.trace_block_tokens as f64
    }

    /// Scales one record; `t0` is the timestamp that maps to time 0.
    ///
    /// Input: `ceil(input × f)`, which keeps the last block partial-but-non-empty
    /// (`block·(n−1) < input' ≤ block·n`), clamped into that range for records that did not
    /// satisfy it before scaling. Output: `round(output × f)`, at least 1.
    pub fn scale(&self, r: &TraceRecord, t0: u64) -> ScaledRequest {
        let f = self.factor();
        let n = r.hash_ids.len();
        let mut input = (r.input_length as f64 * f).ceil() as usize;
        if n > 0 {
            input = input.clamp(self.block_tokens * (n - 1) + 1, self.block_tokens * n);
        }
        let output = ((r.output_length as f64 * f).round() as usize).max(1);
        let ms = r.timestamp.saturating_sub(t0) as f64 / self.time_scale;
        ScaledRequest {
            at: Duration::from_secs_f64(ms / 1000.0),
            input_tokens: input,
            output_tokens: output,
            hash_ids: r.hash_ids.clone(),
        }
    }
}

/// Number of leading hash ids shared by *every* record (a global system prompt).
///
/// In the Mooncake conversation trace every request starts with block 0, so this is 1.
pub fn common_prefix_len(records: &[TraceRecord]) -> usize {
    let Some(first) = records.first() else {
        return 0;
    };
    let mut len = first.hash_ids.len();
    for r in &records[1..] {
        len = len.min(
            first
                .hash_ids
                .iter()
                .zip(&r.hash_ids)
                .take_while(|(a, b)| a == b)
                .count(),
        );
        if len == 0 {
            break;
        }
    }
    len
}

/// The session (conversation) a request belongs to, by heuristic.
///
/// The trace has no session ids. A conversation's later turns repeat the earlier turns'
/// blocks as their prefix, so the first block *after* the prefix that every request shares
/// (the global system prompt, `skip` blocks) identifies the conversation root: requests with
/// the same root id are turns of one conversation. A request with no block beyond the shared
/// prefix uses its last id. In the Mooncake conversation trace `skip` = 1 (block 0 is in
/// every request) and the root is `hash_ids[1]`; of 4,658 consecutive same-root pairs there,
/// 85 % extend the previous turn's blocks exactly.
pub fn session_root(hash_ids: &[u64], skip: usize) -> Option<u64> {
    hash_ids.get(skip).or(hash_ids.last()).copied()
}

/// The prefix-cache hit ceiling of a sequence of requests with an infinite cache shared by
/// all instances: (blocks whose id was seen before / all blocks, the same weighted by tokens).
pub fn ideal_hit_ratio(reqs: &[ScaledRequest], block_tokens: usize) -> (f64, f64) {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hit_blocks, mut blocks) = (0u64, 0u64);
    let (mut hit_tokens, mut tokens) = (0u64, 0u64);
    for r in reqs {
        let mut left = r.input_tokens;
        for &id in &r.hash_ids {
            let n = left.min(block_tokens);
            left -= n;
            blocks += 1;
            tokens += n as u64;
            if !seen.insert(id) {
                hit_blocks += 1;
                hit_tokens += n as u64;
            }
        }
    }
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    (ratio(hit_blocks, blocks), ratio(hit_tokens, tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 500, "hash_ids": [0, 1]}

{"timestamp": 2000, "input_length": 1536, "output_length": 3, "hash_ids": [0, 1, 2]}
{"timestamp": 4500, "input_length": 600, "output_length": 7, "hash_ids": [0, 9]}
"#;

    #[test]
    fn parses_lines_and_skips_blank_ones() {
        let t = parse_trace(SAMPLE).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(
            t[1],
            TraceRecord {
                timestamp: 2000,
                input_length: 1536,
                output_length: 3,
                hash_ids: vec![0, 1, 2]
            }
        );
    }

    #[test]
    fn parse_errors_name_the_line() {
        let e = parse_trace("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n{oops}\n")
            .unwrap_err();
        assert!(format!("{e:#}").contains("trace line 2"), "{e:#}");
        let e = parse_trace("{\"timestamp\": 0, \"input_length\": 1}\n").unwrap_err();
        assert!(format!("{e:#}").contains("trace line 1"));
    }

    #[test]
    fn scaling_keeps_blocks_consistent_and_scales_time() {
        let t = parse_trace(SAMPLE).unwrap();
        let s = Scaling {
            trace_block_tokens: 512,
            block_tokens: 64,
            time_scale: 10.0,
        };
        let r = s.scale(&t[0], 0);
        assert_eq!(r.input_tokens, 125); // 1000 / 8
        assert_eq!(r.output_tokens, 63); // round(62.5)
        assert_eq!(r.at, Duration::ZERO);
        let r = s.scale(&t[1], 0);
        assert_eq!((r.input_tokens, r.output_tokens), (192, 1)); // output ≥ 1
        assert_eq!(r.at, Duration::from_millis(200));
        let r = s.scale(&t[2], 2000);
        assert_eq!(r.at, Duration::from_millis(250));
        // Every scaled request keeps a non-empty last block.
        for rec in &t {
            let r = s.scale(rec, 0);
            let n = r.hash_ids.len();
            assert!(r.input_tokens > 64 * (n - 1) && r.input_tokens <= 64 * n);
        }
        // Identity scaling.
        let r = Scaling::default().scale(&t[0], 0);
        assert_eq!((r.input_tokens, r.output_tokens), (1000, 500));
    }

    #[test]
    fn session_root_skips_the_shared_system_prompt() {
        let t = parse_trace(SAMPLE).unwrap();
        let skip = common_prefix_len(&t);
        assert_eq!(skip, 1);
        assert_eq!(session_root(&t[0].hash_ids, skip), Some(1));
        assert_eq!(session_root(&t[1].hash_ids, skip), Some(1));
        assert_eq!(session_root(&t[2].hash_ids, skip), Some(9));
        assert_eq!(session_root(&[0], 1), Some(0));
        assert_eq!(session_root(&[], 1), None);
        assert_eq!(common_prefix_len(&t[..1]), 2);
    }

    #[test]
    fn ideal_ceiling_counts_repeated_blocks() {
        let t = parse_trace(SAMPLE).unwrap();
        let s = Scaling::default();
        let reqs: Vec<_> = t.iter().map(|r| s.scale(r, 0)).collect();
        let (blocks, tokens) = ideal_hit_ratio(&reqs, 512);
        // blocks: [0,1] [0,1,2] [0,9] → hits: 0,1 (2nd), 0 (3rd) = 3 of 7
        assert!((blocks - 3.0 / 7.0).abs() < 1e-9);
        // tokens: hits 512+512+512 of 1000+1536+600
        assert!((tokens - 1536.0 / 3136.0).abs() < 1e-9);
    }
}
