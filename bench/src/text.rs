//! Deterministic prompt text.
//!
//! A trace names prompt blocks by hash id only; to replay it against a real (or simulated)
//! prefix cache every id must become the *same* text every time it appears, and different ids
//! must become different text. [`BlockText`] maps `(seed, id)` to a stream of words drawn
//! from a small vocabulary by a SplitMix64 generator seeded with both; a block of `tokens`
//! tokens is exactly `tokens × BYTES_PER_TOKEN` ASCII bytes (engine-sim counts 4 bytes per
//! token). A partial block (the last block of a request) is the leading part of the full
//! block's text, so a request that stops early shares its prefix with one that goes on.

/// Bytes per token, as engine-sim's tokenizer counts them.
pub const BYTES_PER_TOKEN: usize = 4;

/// Vocabulary of the generated text (varied lengths so word boundaries do not align with
/// token or KV-block boundaries).
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "cache",
    "token",
    "prefix",
    "gateway",
    "engine",
    "request",
    "stream",
    "latency",
    "batch",
    "decode",
    "prefill",
    "router",
    "session",
    "instance",
    "throughput",
    "kernel",
    "memory",
    "attention",
    "context",
    "window",
    "model",
    "weights",
    "tensor",
    "matrix",
    "vector",
    "sample",
    "query",
    "answer",
    "question",
    "summary",
    "document",
    "paragraph",
    "chapter",
    "history",
    "science",
    "river",
    "mountain",
    "garden",
    "library",
    "window",
    "morning",
    "evening",
    "quickly",
    "slowly",
    "carefully",
    "important",
    "because",
    "although",
    "whenever",
    "between",
    "through",
    "without",
    "another",
    "everything",
    "something",
    "nothing",
    "always",
    "never",
    "sometimes",
    "often",
    "perhaps",
    "probably",
];

/// SplitMix64: tiny, fast, good enough for text; stable across platforms and versions.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Mixes a seed, a namespace and an id into one generator seed.
pub fn mix(seed: u64, namespace: u64, id: u64) -> u64 {
    let mut g = SplitMix64::new(seed ^ namespace.rotate_left(32));
    let a = g.next_u64();
    let mut g = SplitMix64::new(a ^ id);
    g.next_u64()
}

/// Namespaces so that trace blocks, system prompts, user turns and the agentic workload's
/// draws never collide.
pub mod ns {
    pub const TRACE_BLOCK: u64 = 1;
    pub const SYSTEM_PROMPT: u64 = 2;
    pub const USER_TURN: u64 = 3;
    pub const TENANT_SYSTEM: u64 = 4;
    pub const TENANT_SIZE: u64 = 5;
    pub const AGENTIC_TURN: u64 = 6;
    pub const AGENTIC_SESSION: u64 = 7;
    pub const AGENTIC_ARRIVAL: u64 = 8;
}

/// Appends `bytes` bytes of words generated from `stream_seed` to `out`. The text of a
/// shorter call is a prefix of a longer one with the same seed.
pub fn push_words(out: &mut String, stream_seed: u64, bytes: usize) {
    let start = out.len();
    let end = start + bytes;
    out.reserve(bytes);
    let mut g = SplitMix64::new(stream_seed);
    while out.len() < end {
        let w = WORDS[(g.next_u64() % WORDS.len() as u64) as usize];
        let room = end - out.len();
        if w.len() < room {
            out.push_str(w);
            out.push(' ');
        } else {
            // Cut the last word to fit exactly (ASCII, so any byte is a char boundary).
            out.push_str(&w[..room.min(w.len())]);
            while out.len() < end {
                out.push(' ');
            }
        }
    }
}

/// Text for the hash-id blocks of a trace.
#[derive(Clone, Copy, Debug)]
pub struct BlockText {
    pub seed: u64,
    /// Tokens per (full) block.
    pub block_tokens: usize,
}

impl BlockText {
    /// Appends the text of block `id`, `tokens` tokens long (≤ `block_tokens`: the leading
    /// part of the full block).
    pub fn push_block(&self, out: &mut String, id: u64, tokens: usize) {
        let tokens = tokens.min(self.block_tokens);
        push_words(
            out,
            mix(self.seed, ns::TRACE_BLOCK, id),
            tokens * BYTES_PER_TOKEN,
        );
    }

    /// The whole prompt of a request: every block full except the last, which carries the
    /// remaining `input_tokens − block_tokens·(n−1)` tokens.
    pub fn prompt(&self, hash_ids: &[u64], input_tokens: usize) -> String {
        let mut out = String::with_capacity(input_tokens * BYTES_PER_TOKEN);
        let mut left = input_tokens;
        for (i, &id) in hash_ids.iter().enumerate() {
            let n = if i + 1 == hash_ids.len() {
                left
            } else {
                left.min(self.block_tokens)
            };
            self.push_block(&mut out, id, n);
            left -= n.min(left);
        }
        out
    }
}

/// `tokens` tokens of text from one named stream (system prompts, user turns).
pub fn text(seed: u64, namespace: u64, id: u64, tokens: usize) -> String {
    let mut s = String::with_capacity(tokens * BYTES_PER_TOKEN);
    push_words(&mut s, mix(seed, namespace, id), tokens * BYTES_PER_TOKEN);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_ids_give_equal_text_and_different_ids_differ() {
        let bt = BlockText {
            seed: 7,
            block_tokens: 512,
        };
        let (mut a, mut b, mut c) = (String::new(), String::new(), String::new());
        bt.push_block(&mut a, 42, 512);
        bt.push_block(&mut b, 42, 512);
        bt.push_block(&mut c, 43, 512);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 2048);
        assert!(a.bytes().all(|b| b.is_ascii_lowercase() || b == b' '));
        assert!(
            a.split(' ').filter(|w| !w.is_empty()).count() > 200,
            "made of words"
        );
        let other_seed = BlockText { seed: 8, ..bt };
        let mut d = String::new();
        other_seed.push_block(&mut d, 42, 512);
        assert_ne!(a, d);
    }

    #[test]
    fn partial_last_block_is_a_prefix_of_the_full_block() {
        let bt = BlockText {
            seed: 1,
            block_tokens: 512,
        };
        let full = bt.prompt(&[0, 1, 2], 3 * 512);
        let short = bt.prompt(&[0, 1, 2], 2 * 512 + 100);
        assert_eq!(full.len(), 3 * 2048);
        assert_eq!(short.len(), (2 * 512 + 100) * 4);
        assert!(full.starts_with(&short));
        // Two requests sharing ids [0, 1] share exactly their first 2 blocks of text.
        let other = bt.prompt(&[0, 1, 9], 2 * 512 + 10);
        assert_eq!(other[..4096], full[..4096]);
        assert_ne!(other[4096..], short[4096..4096 + 40]);
    }

    #[test]
    fn scaled_blocks_have_scaled_sizes() {
        let bt = BlockText {
            seed: 1,
            block_tokens: 64,
        };
        let p = bt.prompt(&[5, 6], 64 + 3);
        assert_eq!(p.len(), (64 + 3) * 4);
        let mut b5 = String::new();
        bt.push_block(&mut b5, 5, 64);
        assert!(p.starts_with(&b5));
    }

    #[test]
    fn named_streams_are_stable() {
        assert_eq!(
            text(3, ns::SYSTEM_PROMPT, 0, 100),
            text(3, ns::SYSTEM_PROMPT, 0, 100)
        );
        assert_ne!(
            text(3, ns::SYSTEM_PROMPT, 0, 100),
            text(3, ns::USER_TURN, 0, 100)
        );
        assert_eq!(text(3, ns::USER_TURN, 5, 10).len(), 40);
    }
}
