//! Paged KV cache with automatic prefix caching, modelled on vLLM v1.
//!
//! * The prompt is split into blocks of `block_size` tokens; only *full*
//!   blocks are cacheable. Each block is identified by a chained hash
//!   (xxh3 of the block bytes, seeded with the previous block's hash), so a
//!   block hit implies the whole prefix before it matches.
//! * A request references every block it uses while it runs (its cacheable
//!   prompt blocks plus anonymous blocks for the partial tail and the output).
//!   Referenced blocks are never evicted.
//! * Released cacheable blocks stay in the cache, ordered least-recently-used
//!   first; a request's tail blocks are released first so they are evicted
//!   before its head blocks (as vLLM does).
//! * When a request does not fit even after evicting every unreferenced
//!   block, [`KvCache::allocate`] returns `None` and the scheduler keeps the
//!   request waiting (FCFS head-of-line blocking, like vLLM).
//! * Optionally ([`KvCache::with_cache_limit`]) at most so many unreferenced
//!   blocks are kept: a prefix cache smaller than the pool that running
//!   requests draw from (the least recently used go first).

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes per token of the simulator's deterministic "tokenizer".
pub const BYTES_PER_TOKEN: usize = 4;

/// Number of tokens of a rendered prompt: 4 bytes per token, the last partial
/// chunk counts as one token, at least one token.
pub fn token_count(bytes: &[u8]) -> usize {
    token_count_at(bytes, BYTES_PER_TOKEN as f64)
}

/// [`token_count`] with `bytes_per_token` bytes per token (`--bytes-per-token`: an
/// engine whose tokenizer counts differently from the gateway's 4-byte estimate).
pub fn token_count_at(bytes: &[u8], bytes_per_token: f64) -> usize {
    ((bytes.len() as f64 / bytes_per_token).ceil() as usize).max(1)
}

/// Chained hashes of the full blocks of `bytes` (`block_size` tokens each).
pub fn block_hashes(bytes: &[u8], block_size: usize) -> Vec<u64> {
    block_hashes_at(bytes, block_size, BYTES_PER_TOKEN as f64)
}

/// [`block_hashes`] with `bytes_per_token` bytes per token: block `i` covers the bytes
/// of tokens `i × block_size ..` rounded to whole bytes.
pub fn block_hashes_at(bytes: &[u8], block_size: usize, bytes_per_token: f64) -> Vec<u64> {
    let tokens = token_count_at(bytes, bytes_per_token);
    let full = tokens / block_size;
    let edge = |i: usize| ((i * block_size) as f64 * bytes_per_token).round() as usize;
    let mut out = Vec::with_capacity(full);
    let mut prev = 0u64;
    for i in 0..full {
        let start = edge(i);
        let end = edge(i + 1).min(bytes.len());
        let chunk = if start < end {
            &bytes[start..end]
        } else {
            &[][..]
        };
        prev = xxh3_64_with_seed(chunk, prev ^ 0x9e37_79b9_7f4a_7c15);
        out.push(prev);
    }
    out
}

#[derive(Debug)]
struct Entry {
    refs: u32,
    /// LRU stamp while unreferenced (key in `free_lru`).
    stamp: u64,
}

/// The block pool.
#[derive(Debug)]
pub struct KvCache {
    capacity: usize,
    blocks: HashMap<u64, Entry>,
    /// Unreferenced cached blocks, oldest stamp first.
    free_lru: BTreeMap<u64, u64>,
    /// Blocks in use that are not cacheable (partial tail + output tokens).
    anon: usize,
    /// Cacheable blocks with refs > 0.
    referenced: usize,
    clock: u64,
    evictions: u64,
    /// Most unreferenced blocks kept (`None`: the pool's capacity bounds them).
    cache_limit: Option<usize>,
}

impl KvCache {
    pub fn new(capacity: usize) -> Self {
        KvCache {
            capacity,
            blocks: HashMap::new(),
            free_lru: BTreeMap::new(),
            anon: 0,
            referenced: 0,
            clock: 0,
            evictions: 0,
            cache_limit: None,
        }
    }

    /// A pool of `capacity` blocks that keeps at most `limit` unreferenced
    /// blocks (released blocks beyond it are evicted, least recently used first).
    pub fn with_cache_limit(capacity: usize, limit: usize) -> Self {
        KvCache {
            cache_limit: Some(limit),
            ..KvCache::new(capacity)
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of leading blocks of `hashes` present in the cache.
    pub fn match_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Reference the blocks of a request: `hashes` (cacheable prompt blocks)
    /// plus `anon` anonymous blocks. Returns the number of leading cache-hit
    /// blocks (at most `max_hit`), or `None` (nothing changed) if the request
    /// does not fit even after evicting all unreferenced blocks.
    pub fn allocate(&mut self, hashes: &[u64], max_hit: usize, anon: usize) -> Option<usize> {
        let hit = self.match_prefix(hashes).min(max_hit);
        let mut absent = 0usize;
        let mut present_unref = 0usize;
        for h in hashes {
            match self.blocks.get(h) {
                None => absent += 1,
                Some(e) if e.refs == 0 => present_unref += 1,
                Some(_) => {}
            }
        }
        let need = absent + anon;
        let free = self.capacity.saturating_sub(self.blocks.len() + self.anon);
        let evictable = self.free_lru.len() - present_unref;
        if need > free + evictable {
            return None;
        }
        // Reference present blocks first so they cannot be evicted below.
        for h in hashes {
            if let Some(e) = self.blocks.get_mut(h) {
                if e.refs == 0 {
                    self.free_lru.remove(&e.stamp);
                    self.referenced += 1;
                }
                e.refs += 1;
            }
        }
        while self.capacity.saturating_sub(self.blocks.len() + self.anon) < need {
            let (_, victim) = self.free_lru.pop_first().expect("checked evictable");
            self.blocks.remove(&victim);
            self.evictions += 1;
        }
        for h in hashes {
            self.blocks.entry(*h).or_insert_with(|| {
                self.referenced += 1;
                Entry { refs: 1, stamp: 0 }
            });
        }
        self.anon += anon;
        Some(hit)
    }

    /// Drop a request's references (same arguments as [`allocate`](Self::allocate)).
    pub fn release(&mut self, hashes: &[u64], anon: usize) {
        self.anon -= anon.min(self.anon);
        // Tail first: the tail gets the oldest stamp and is evicted first.
        for h in hashes.iter().rev() {
            if let Some(e) = self.blocks.get_mut(h) {
                if e.refs > 0 {
                    e.refs -= 1;
                    if e.refs == 0 {
                        self.clock += 1;
                        e.stamp = self.clock;
                        self.free_lru.insert(self.clock, *h);
                        self.referenced -= 1;
                    }
                }
            }
        }
        if let Some(limit) = self.cache_limit {
            while self.free_lru.len() > limit {
                let (_, victim) = self.free_lru.pop_first().expect("over the limit");
                self.blocks.remove(&victim);
                self.evictions += 1;
            }
        }
    }

    /// Drop every unreferenced cached block (vLLM's `/reset_prefix_cache`).
    pub fn reset(&mut self) {
        while let Some((_, h)) = self.free_lru.pop_first() {
            self.blocks.remove(&h);
        }
    }

    /// Blocks in use by running requests (cached-but-unreferenced blocks are
    /// free, as in vLLM).
    pub fn used_blocks(&self) -> usize {
        self.referenced + self.anon
    }

    /// Fraction of blocks in use (vLLM's `kv_cache_usage_perc`, 0..=1).
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.used_blocks() as f64 / self.capacity as f64
        }
    }

    /// Cacheable blocks currently held (referenced or not).
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| seed.wrapping_add((i % 251) as u8))
            .collect()
    }

    #[test]
    fn tokens_and_blocks() {
        assert_eq!(token_count(b""), 1);
        assert_eq!(token_count(b"abcd"), 1);
        assert_eq!(token_count(b"abcde"), 2);
        // 16 tokens per block = 64 bytes; 130 bytes = 33 tokens = 2 full blocks
        assert_eq!(block_hashes(&prompt(1, 130), 16).len(), 2);
        assert_eq!(block_hashes(&prompt(1, 60), 16).len(), 0);
        assert_eq!(block_hashes(&prompt(1, 61), 16).len(), 1);
        // chained: same second block bytes after a different first block differ
        let mut a = prompt(1, 128);
        let b = block_hashes(&a, 16);
        a[0] ^= 1;
        let c = block_hashes(&a, 16);
        assert_ne!(b[0], c[0]);
        assert_ne!(b[1], c[1]);
    }

    #[test]
    fn repeat_prompt_hits() {
        let mut kv = KvCache::new(100);
        let h = block_hashes(&prompt(7, 64 * 5), 16);
        assert_eq!(h.len(), 5);
        assert_eq!(kv.allocate(&h, 4, 1), Some(0));
        kv.release(&h, 1);
        assert_eq!(kv.used_blocks(), 0);
        assert_eq!(kv.cached_blocks(), 5);
        // max_hit caps the hit (vLLM recomputes the last prompt token)
        assert_eq!(kv.allocate(&h, 4, 1), Some(4));
        kv.release(&h, 1);
        assert_eq!(kv.allocate(&h, 10, 0), Some(5));
    }

    #[test]
    fn shared_prefix() {
        let mut kv = KvCache::new(100);
        let a = prompt(3, 64 * 4);
        let mut b = a.clone();
        b.truncate(64 * 2);
        b.extend(prompt(99, 64 * 3));
        let ha = block_hashes(&a, 16);
        let hb = block_hashes(&b, 16);
        kv.allocate(&ha, 10, 0).unwrap();
        // referenced blocks are shared while both run
        assert_eq!(kv.allocate(&hb, 10, 0), Some(2));
        assert_eq!(kv.used_blocks(), 4 + 3);
        kv.release(&ha, 0);
        kv.release(&hb, 0);
        assert_eq!(kv.used_blocks(), 0);
        assert_eq!(kv.cached_blocks(), 7);
    }

    #[test]
    fn lru_eviction_and_pinning() {
        let mut kv = KvCache::new(6);
        let a = block_hashes(&prompt(1, 64 * 3), 16);
        let b = block_hashes(&prompt(2, 64 * 3), 16);
        let c = block_hashes(&prompt(3, 64 * 3), 16);
        kv.allocate(&a, 9, 0).unwrap();
        kv.release(&a, 0);
        kv.allocate(&b, 9, 0).unwrap();
        kv.release(&b, 0);
        // touch a so b becomes least recently used
        assert_eq!(kv.allocate(&a, 9, 0), Some(3));
        kv.release(&a, 0);
        kv.allocate(&c, 9, 0).unwrap();
        assert_eq!(kv.evictions(), 3);
        assert_eq!(kv.match_prefix(&a), 3);
        assert_eq!(kv.match_prefix(&b), 0);
        // c is referenced: a request needing 6 fresh blocks cannot fit
        let d = block_hashes(&prompt(4, 64 * 6), 16);
        assert_eq!(kv.allocate(&d, 9, 0), None);
        assert_eq!(kv.match_prefix(&a), 3, "failed allocation changes nothing");
        // one fresh block fits by evicting the tail of a (oldest)
        let e = block_hashes(&prompt(5, 64), 16);
        kv.allocate(&e, 9, 0).unwrap();
        assert_eq!(kv.match_prefix(&a), 2);
        kv.release(&c, 0);
        kv.release(&e, 0);
        assert_eq!(kv.allocate(&d, 9, 0), Some(0));
        assert_eq!(kv.usage(), 1.0);
    }

    #[test]
    fn cache_limit_bounds_unreferenced_blocks_only() {
        let mut kv = KvCache::with_cache_limit(100, 4);
        let a = block_hashes(&prompt(1, 64 * 3), 16);
        let b = block_hashes(&prompt(2, 64 * 3), 16);
        // running requests may hold more than the limit
        kv.allocate(&a, 9, 0).unwrap();
        kv.allocate(&b, 9, 0).unwrap();
        assert_eq!(kv.cached_blocks(), 6);
        kv.release(&a, 0);
        assert_eq!((kv.cached_blocks(), kv.evictions()), (6, 0));
        // b released: 6 unreferenced, the limit keeps 4, a's (older) go first, tail first
        kv.release(&b, 0);
        assert_eq!((kv.cached_blocks(), kv.evictions()), (4, 2));
        assert_eq!(kv.match_prefix(&a), 1);
        assert_eq!(kv.match_prefix(&b), 3);
        // without a limit nothing is evicted
        let mut kv = KvCache::new(100);
        kv.allocate(&a, 9, 0).unwrap();
        kv.allocate(&b, 9, 0).unwrap();
        kv.release(&a, 0);
        kv.release(&b, 0);
        assert_eq!((kv.cached_blocks(), kv.evictions()), (6, 0));
    }

    #[test]
    fn anonymous_blocks_count() {
        let mut kv = KvCache::new(4);
        assert_eq!(kv.allocate(&[], 0, 3), Some(0));
        assert_eq!(kv.allocate(&[], 0, 2), None);
        kv.release(&[], 3);
        assert_eq!(kv.allocate(&[], 0, 4), Some(0));
    }
}
