//! The prefix-hit ceiling of chat workloads (synthetic and agentic sessions).
//!
//! The ceiling is what one infinite KV cache shared by every engine would have served: each
//! request's prompt is rendered the way engine-sim renders a chat (`<|role|>\n` + content +
//! `\n` per message, 4 bytes per token), cut into the engines' full blocks of `block_size`
//! tokens with engine-sim's own chained block hashes, and its leading blocks already seen in
//! an earlier request of the run are hits. Like the engines, a hit never covers the last
//! prompt token (`(prompt − 1) / block_size` blocks at most), and only full prompt blocks are
//! cached (not the partial tail, not the answer until it comes back in the next prompt).
//! Requests are counted in the order they are sent.

use std::collections::HashSet;

use engine_sim::kvcache::{block_hashes, token_count};

/// A chat rendered as engine-sim's chat template does (`sim/src/api.rs`, `render_turn`):
/// for every message `<|role|>\n`, its text, `\n`.
pub fn render_chat<S: AsRef<str>>(messages: &[(&str, S)]) -> Vec<u8> {
    let len = messages
        .iter()
        .map(|(r, c)| r.len() + c.as_ref().len() + 6)
        .sum();
    let mut out = Vec::with_capacity(len);
    for (role, content) in messages {
        out.extend_from_slice(b"<|");
        out.extend_from_slice(role.as_bytes());
        out.extend_from_slice(b"|>\n");
        out.extend_from_slice(content.as_ref().as_bytes());
        out.push(b'\n');
    }
    out
}

/// One infinite prefix cache shared by all engines: the hit ceiling of the requests shown to
/// it, in order.
#[derive(Clone, Debug)]
pub struct IdealCache {
    block_size: usize,
    seen: HashSet<u64>,
    /// Full prompt blocks of every request.
    pub blocks: u64,
    /// Of those, leading blocks seen before (capped like the engines').
    pub hit_blocks: u64,
    /// Prompt tokens of every request (engine-sim's count).
    pub tokens: u64,
    /// `hit_blocks × block_size`.
    pub hit_tokens: u64,
}

impl IdealCache {
    /// `block_size`: tokens per KV block of the engines (at least 1).
    pub fn new(block_size: usize) -> Self {
        IdealCache {
            block_size: block_size.max(1),
            seen: HashSet::new(),
            blocks: 0,
            hit_blocks: 0,
            tokens: 0,
            hit_tokens: 0,
        }
    }

    /// Counts one request's rendered prompt; returns the tokens an infinite shared cache
    /// would have served.
    pub fn observe(&mut self, prompt: &[u8]) -> u64 {
        let bs = self.block_size;
        let tokens = token_count(prompt);
        let hashes = block_hashes(prompt, bs);
        let max_hit = (tokens - 1) / bs;
        let hit = hashes
            .iter()
            .take_while(|h| self.seen.contains(h))
            .count()
            .min(max_hit);
        self.seen.extend(hashes.iter().copied());
        self.blocks += hashes.len() as u64;
        self.hit_blocks += hit as u64;
        self.tokens += tokens as u64;
        let hit_tokens = (hit * bs) as u64;
        self.hit_tokens += hit_tokens;
        hit_tokens
    }

    /// Requests observed so far contributed any tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// (hit blocks ÷ blocks, hit tokens ÷ prompt tokens); 0 when nothing was observed.
    pub fn ratios(&self) -> (f64, f64) {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        (
            ratio(self.hit_blocks, self.blocks),
            ratio(self.hit_tokens, self.tokens),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_like_engine_sim() {
        let m = [("system", "S"), ("user", "ab")];
        assert_eq!(render_chat(&m), b"<|system|>\nS\n<|user|>\nab\n".to_vec());
        assert!(render_chat::<&str>(&[]).is_empty());
    }

    /// Blocks of 4 tokens = 16 bytes; text made of distinct 16-byte pieces.
    #[test]
    fn hand_checked_ceiling() {
        let piece = |c: u8| vec![c; 16];
        let cat = |ps: &[u8], extra: usize| {
            let mut v: Vec<u8> = ps.iter().flat_map(|&c| piece(c)).collect();
            v.extend(std::iter::repeat_n(b'z', extra));
            v
        };
        let mut c = IdealCache::new(4);
        // A: blocks a b + 8 bytes (2 tokens): 10 tokens, 2 full blocks, nothing seen.
        assert_eq!(c.observe(&cat(b"ab", 8)), 0);
        // B: a b c: 12 tokens, 3 blocks; a b seen → 2 hits (max (12−1)/4 = 2).
        assert_eq!(c.observe(&cat(b"abc", 0)), 8);
        // C: a b c again: 3 seen, but at most (12−1)/4 = 2 (the last token is recomputed).
        assert_eq!(c.observe(&cat(b"abc", 0)), 8);
        // D: x a b: the prefix differs, the chained hashes of a b differ too → 0.
        assert_eq!(c.observe(&cat(b"xab", 1)), 0);
        // E: a b c d + 1 token: 17 tokens, 4 blocks, a b c seen → 3.
        assert_eq!(c.observe(&cat(b"abcd", 4)), 12);
        assert_eq!(c.tokens, 10 + 12 + 12 + 13 + 17);
        assert_eq!((c.blocks, c.hit_blocks, c.hit_tokens), (15, 7, 28));
        let (b, t) = c.ratios();
        assert!((b - 7.0 / 15.0).abs() < 1e-12);
        assert!((t - 28.0 / 64.0).abs() < 1e-12);
        assert_eq!(IdealCache::new(16).ratios(), (0.0, 0.0));
    }
}
