//! The prefix index's prediction in an engine's own units.
//!
//! The index counts blocks of `prefix_index.block_size` *estimated* tokens (4 prompt bytes
//! each). An engine counts its tokenizer's tokens, caches whole blocks of its own size (vLLM:
//! 16 tokens on GPU, 128 on CPU; SGLang: its page size, often 1) and always recomputes the
//! prompt's last token. So on an engine that evicted nothing it reports fewer cached tokens
//! than the index's matched blocks say: up to one engine block less, plus the difference
//! between the tokenizers. [`check`] converts the index's match into the engine's units — the
//! index blocks scaled by the engine's prompt tokens over the index's blocks, capped at the
//! prompt less one token, rounded down to the engine's block — and calls for a correction
//! only when the engine reported more than that rounding less.

/// What one completed request says about the index's prediction for its instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Check {
    /// The cached tokens the index predicted, in the engine's units (comparable with the
    /// engine's `cached_tokens`).
    pub expected: u64,
    /// `Some(n)`: the engine holds fewer blocks than the index believes (it evicted them);
    /// keep only the first `n` index blocks of this prompt on the instance.
    pub trim_to: Option<usize>,
}

/// Compares the index's match (`matched` of the prompt's `index_blocks`) with the engine's
/// report (`prompt` tokens of which `cached` came from its cache), for an engine that caches
/// blocks of `engine_block` tokens (1 when unknown).
pub fn check(
    index_blocks: usize,
    matched: u32,
    prompt: u64,
    cached: u64,
    engine_block: u64,
) -> Check {
    if prompt == 0 || index_blocks == 0 {
        return Check {
            expected: 0,
            trim_to: None,
        };
    }
    let b = engine_block.max(1);
    // Engine tokens per index block.
    let per_block = prompt as f64 / index_blocks as f64;
    let predicted = (f64::from(matched) * per_block).min((prompt - 1) as f64);
    let expected = (predicted as u64 / b) * b;
    // Rounding: the scaled boundary may fall one engine block either side of the engine's
    // own, and the scale itself may be one index block off.
    let slack = b as f64 + per_block;
    let trim_to = ((cached as f64) + slack < expected as f64)
        .then(|| (cached as f64 / per_block).round() as usize);
    Check { expected, trim_to }
}

/// The block size an engine caches in, learned from the `cached_tokens` it reports: every
/// report is a whole number of blocks, so their greatest common divisor is the block size
/// (or a multiple of it until the reports differ: the caller caps it at
/// [`MAX_LEARNED_BLOCK`]).
pub fn learn_block(previous: u64, cached: u64) -> u64 {
    match (previous, cached) {
        (p, 0) => p,
        (0, c) => c,
        (p, c) => gcd(p, c),
    }
}

/// The largest block size [`learn_block`]'s figure is used as: vLLM's blocks are 16 (GPU) or
/// 128 (CPU) tokens, SGLang's pages 1 to 64; a larger figure is most often a multiple of the
/// block from reports that have not differed yet, and taken whole it would hide real
/// evictions of short prompts. An engine with larger blocks says so in its metrics
/// (`engine_metrics`) or in `cache_block_tokens`.
pub const MAX_LEARNED_BLOCK: u64 = 128;

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_healthy_engine_with_large_blocks_is_not_trimmed() {
        // vLLM on CPU: 128-token blocks. A 1,000-token prompt the index holds whole (63
        // index blocks) comes back with 896 cached: all the engine can hold of it.
        let c = check(63, 63, 1000, 896, 128);
        assert_eq!(
            c,
            Check {
                expected: 896,
                trim_to: None
            }
        );
        // The same report judged in 1-token blocks (the old rule) calls for a trim.
        assert!(check(63, 63, 1000, 896, 1).trim_to.is_some());
    }

    #[test]
    fn a_tokenizer_that_counts_differently_is_scaled() {
        // The engine counts 15 % more tokens than the index estimates: 1,150 for 63 blocks.
        let c = check(63, 63, 1150, 1024, 128);
        assert_eq!(c.trim_to, None);
        assert_eq!(c.expected, 1024);
        // And 15 % fewer.
        assert_eq!(check(63, 63, 850, 768, 128).trim_to, None);
    }

    #[test]
    fn an_engine_that_evicted_is_trimmed_to_what_it_reported() {
        // After /reset_prefix_cache: nothing cached, the index believed 63 blocks.
        assert_eq!(check(63, 63, 1000, 0, 128).trim_to, Some(0));
        // Half evicted: 384 of 896.
        assert_eq!(check(63, 63, 1000, 384, 128).trim_to, Some(24));
        // A partial match (a shared system prompt of 40 blocks): 640 tokens expected.
        let c = check(63, 40, 1000, 640, 128);
        assert_eq!(
            c,
            Check {
                expected: 512,
                trim_to: None
            }
        );
        assert_eq!(check(63, 40, 1000, 0, 128).trim_to, Some(0));
    }

    #[test]
    fn small_blocks_keep_the_old_tolerance() {
        // SGLang (page 1) or engine-sim (16): a shortfall of more than one index block and
        // one engine block trims, less does not.
        assert_eq!(check(64, 64, 1024, 1008, 16).trim_to, None);
        assert_eq!(check(64, 64, 1024, 960, 16).trim_to, Some(60));
        assert_eq!(check(64, 64, 1024, 960, 1).trim_to, Some(60));
    }

    #[test]
    fn nothing_to_say_about_an_empty_prompt() {
        assert_eq!(check(0, 0, 0, 0, 16).trim_to, None);
        assert_eq!(check(0, 0, 5, 0, 16).expected, 0);
    }

    #[test]
    fn the_block_size_is_the_gcd_of_the_reports() {
        let mut b = 0;
        for c in [0, 896, 0, 768, 1024] {
            b = learn_block(b, c);
        }
        assert_eq!(b, 128);
        assert_eq!(learn_block(0, 896), 896);
        assert_eq!(learn_block(128, 100), 4);
    }
}
