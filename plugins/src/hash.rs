//! Hashing helpers: stable keys for instances and sessions, and the chained block hashes
//! the prefix index is keyed by.
//!
//! * [`InstanceKey`] / [`SessionKey`] are 64-bit xxh3 digests of the gateway's string ids.
//!   They are `Copy`, cheap to compare and to store in the sharded tables; with a few
//!   thousand instances and 10⁵–10⁶ sessions the collision probability (n²/2⁶⁵) is
//!   negligible. They are stable across config reloads as long as the string id is.
//! * [`block_hashes`] cuts a prompt into full blocks of `block_bytes` bytes and chains them:
//!   `h₀ = xxh3(block₀, seed)`, `hᵢ = xxh3(blockᵢ, seed = hᵢ₋₁)`. Because every hash depends
//!   on all earlier blocks, one hash names a whole prefix — the property the prefix index
//!   relies on. A trailing partial block is not hashed (engines only cache full blocks).

use std::hash::{BuildHasher, Hasher};
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

const INSTANCE_SEED: u64 = 0x1457_a9ce_0000_0001;
const SESSION_SEED: u64 = 0x5e55_1011_0000_0002;

/// A stable, cheap identifier of one engine instance (xxh3 of its string id).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceKey(pub u64);

impl InstanceKey {
    /// The key of the instance with this gateway id (e.g. `"llama-0"`).
    pub fn of(id: &str) -> Self {
        InstanceKey(xxh3_64_with_seed(id.as_bytes(), INSTANCE_SEED))
    }
}

/// A session identifier (xxh3 of the session key string the gateway extracted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(pub u64);

impl SessionKey {
    pub fn of(key: &str) -> Self {
        SessionKey(xxh3_64_with_seed(key.as_bytes(), SESSION_SEED))
    }
}

/// Chained xxh3 hashes of the full `block_bytes`-sized blocks of `prompt` (seed 0).
/// Returns an empty vector when `block_bytes` is 0 or the prompt is shorter than one block.
pub fn block_hashes(prompt: &[u8], block_bytes: usize) -> Vec<u64> {
    let mut out = Vec::new();
    block_hashes_into(prompt, block_bytes, 0, &mut out);
    out
}

/// Like [`block_hashes`], with a seed for the first block, appending to `out` (cleared
/// first). A per-process random seed makes the hashes unpredictable to clients, which keeps
/// the index's hash maps safe from crafted collisions; any seed works as long as one index
/// always sees hashes made with the same one.
pub fn block_hashes_into(prompt: &[u8], block_bytes: usize, seed: u64, out: &mut Vec<u64>) {
    out.clear();
    if block_bytes == 0 {
        return;
    }
    out.reserve(prompt.len() / block_bytes);
    let mut prev = seed;
    for block in prompt.chunks_exact(block_bytes) {
        prev = xxh3_64_with_seed(block, prev);
        out.push(prev);
    }
}

/// Rendezvous (highest-random-weight) hash of a (session, instance) pair: a per-session
/// deterministic preference order over instances that moves only 1/n of the sessions when an
/// instance joins or leaves.
pub fn rendezvous(session: SessionKey, instance: InstanceKey) -> u64 {
    let mut h = Xxh3::with_seed(session.0);
    h.update(&instance.0.to_le_bytes());
    h.digest()
}

/// Which of `n` (a power of two) shards a pre-hashed key lives in. Uses middle bits: hashbrown
/// uses the low bits for the bucket and the top 7 for its control byte, so those stay
/// independent of the shard choice.
#[inline]
pub(crate) fn shard_of(h: u64, n: usize) -> usize {
    ((h >> 32) as usize) & (n - 1)
}

/// A `BuildHasher` for keys that already are good 64-bit hashes (block hashes, instance and
/// session keys): hashing them again would only cost time.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PreHashed;

impl BuildHasher for PreHashed {
    type Hasher = PreHasher;
    fn build_hasher(&self) -> PreHasher {
        PreHasher(0)
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PreHasher(u64);

impl Hasher for PreHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used by u64 keys; fold anything else in so it is still a valid hasher.
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = i;
    }
}

/// Rounds a shard count up to a power of two in `1..=1024`.
pub(crate) fn shard_count(n: usize) -> usize {
    n.clamp(1, 1024).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_blocks_only_and_chained() {
        let p = b"aaaabbbbccccdd";
        let h = block_hashes(p, 4);
        assert_eq!(h.len(), 3);
        // Same block content at a different position hashes differently (chained).
        let same = block_hashes(b"aaaaaaaa", 4);
        assert_ne!(same[0], same[1]);
        // A shared prefix gives shared leading hashes, then they diverge for good.
        let a = block_hashes(b"sys-sys-userAAAAtail", 4);
        let b = block_hashes(b"sys-sys-userBBBBtail", 4);
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a[3], b[3]);
        assert_ne!(a[4], b[4]);
    }

    #[test]
    fn degenerate_inputs() {
        assert!(block_hashes(b"abc", 4).is_empty());
        assert!(block_hashes(b"abcdef", 0).is_empty());
        assert!(block_hashes(b"", 64).is_empty());
    }

    #[test]
    fn seeds_change_hashes_and_keys_are_stable() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        block_hashes_into(b"12345678", 4, 1, &mut a);
        block_hashes_into(b"12345678", 4, 2, &mut b);
        assert_ne!(a, b);
        assert_eq!(InstanceKey::of("x"), InstanceKey::of("x"));
        assert_ne!(InstanceKey::of("x"), InstanceKey::of("y"));
        assert_ne!(SessionKey::of("x").0, InstanceKey::of("x").0);
    }

    #[test]
    fn shard_count_is_a_power_of_two() {
        assert_eq!(shard_count(0), 1);
        assert_eq!(shard_count(3), 4);
        assert_eq!(shard_count(64), 64);
        assert_eq!(shard_count(1 << 20), 1024);
    }
}
