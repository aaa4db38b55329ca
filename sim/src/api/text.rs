//! The filler text of a response: one word per token, from a seed.

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
