//! The prefix index: which instance probably holds which prompt prefix in its KV cache.
//!
//! # What it models
//! An engine (vLLM, SGLang) caches the KV of full token blocks and reuses them when a later
//! request starts with the same blocks. The gateway never sees the engine's cache, so it keeps
//! its own approximation: every prompt it dispatches is inserted for the chosen instance, and
//! entries age out (TTL, and an LRU memory bound) roughly like the engine's cache does.
//!
//! # Data structure: a sharded radix tree over chained block hashes
//! Prompts are cut into full blocks and hashed with a chain ([`crate::hash::block_hashes`]):
//! block *i*'s hash covers blocks `0..=i`, so a path of hashes is a prompt prefix. The index is
//! a radix (compressed) tree whose edges are runs of block hashes:
//!
//! ```text
//!   shard root ── [s0 s1 s2 … s31] (system prompt; held by i1,i2,i3)
//!                    ├── [u0 … u87]  (held by i1)      one node per divergent tail,
//!                    └── [v0 … v95]  (held by i2,i3)   8 bytes per block
//! ```
//!
//! Why a radix tree and not a flat hash map keyed by chained hash (which would also be a
//! trie, the parent being implicit in the chain):
//! * memory: a flat map pays a hash-table slot + holder list for *every* block (≈ 50 B per
//!   block); here a block costs 8 bytes in its edge plus a share of its node (≈ 10 B per block
//!   on the benchmark workload — see `benches/prefix.rs`);
//! * speed: a new 8 KiB prompt's unique tail becomes one `Vec` copy instead of ~100 random
//!   hash-table inserts (each a cache miss in a table of millions of entries); matching walks a
//!   few nodes and compares hashes sequentially.
//!
//! Sharding: the forest is split by the hash of the prompt's *first* block into `shards`
//! trees, each behind its own `parking_lot::RwLock` — there is no global lock. Matching takes a
//! read lock. Inserting a prompt whose path already exists and already lists the instance
//! (the common case under prefix-aware routing) also takes only a read lock: holder timestamps
//! are atomics refreshed with `fetch_max`. Only structural changes (a new branch, a split, a
//! new holder) take the shard's write lock. Prompts sharing a first block (one system prompt)
//! share a shard; that is inherent to a tree, and the read-mostly design keeps it cheap.
//!
//! # Holders and timestamps
//! Each node lists the instances ("holders") believed to hold its whole edge, each with the
//! last time (in 100 ms ticks) it was used. Invariant: a child's holders are a subset of its
//! parent's, and a holder's timestamp in a child is ≤ its timestamp in the parent (every
//! insert/touch refreshes the whole path, with `max`). Hence expiring or evicting by time
//! always removes the *bottom* of a path, never a middle, and the per-instance match length is
//! "depth of the deepest node listing the instance on the prompt's path".
//!
//! # Parameters
//! * `ttl` (default 72 h = 259 200 s): a holder not used for this long is dropped (on match it
//!   is ignored at once; [`PrefixIndex::sweep_expired`] frees its memory). Engine caches turn
//!   over much faster under load; the TTL only bounds stale entries of idle instances.
//! * `shards` (default 64, rounded to a power of two): lock striping.
//! * memory bound: the gateway decides when (e.g. from cgroup memory) and calls
//!   [`PrefixIndex::evict_lru`] / [`PrefixIndex::evict_to`]; eviction removes whole nodes with
//!   the oldest last-use time (a 1024-bucket histogram finds the cut-off in two read passes).
//!   [`PrefixIndex::approx_bytes`] counts edges, holders, node structs, hash-table slots and
//!   allocator headers; the benchmark checks it against a counting allocator.
//!
//! Approximations, on purpose: a prompt ending inside an edge refreshes the whole edge; nodes
//! left with a single child after an eviction are not merged back; a match racing a
//! concurrent eviction may see a slightly shorter prefix. All only nudge a heuristic.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::mem;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use parking_lot::{Mutex, RwLock};

use crate::hash::{shard_count, shard_of, InstanceKey};

mod audit;
mod evict;
mod node;
#[cfg(test)]
mod tests;

use node::{Counters, Holder, Node, HOLDER_BYTES};

/// Configuration of one prefix index.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixIndexConfig {
    /// A holder unused for this long is dropped. Default 259 200 s (72 h).
    pub ttl_ms: u64,
    /// Lock stripes (rounded up to a power of two). Default 64.
    pub shards: usize,
}

impl Default for PrefixIndexConfig {
    fn default() -> Self {
        PrefixIndexConfig {
            ttl_ms: 259_200_000,
            shards: 64,
        }
    }
}

/// The result of matching a prompt against the index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Blocks in the prompt.
    pub prompt_blocks: u32,
    /// The longest match over every instance in the index.
    pub best: u32,
    /// Matched leading blocks per instance (instances with no match are absent).
    pub per_instance: Vec<(InstanceKey, u32)>,
}

impl PrefixMatch {
    /// Matched leading blocks of `key` (0 when absent).
    pub fn matched(&self, key: InstanceKey) -> u32 {
        self.per_instance
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, m)| *m)
    }

    /// `matched / prompt_blocks` (0 for an empty prompt).
    pub fn ratio(&self, key: InstanceKey) -> f64 {
        if self.prompt_blocks == 0 {
            0.0
        } else {
            f64::from(self.matched(key)) / f64::from(self.prompt_blocks)
        }
    }
}

/// Gauges and counters of one index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexGauges {
    /// Tree nodes (edges).
    pub nodes: u64,
    /// Cached blocks (sum of edge lengths).
    pub blocks: u64,
    /// Approximate heap bytes (see [`PrefixIndex::approx_bytes`]).
    pub bytes: u64,
    /// Nodes removed by [`PrefixIndex::evict_lru`] since creation.
    pub evicted_nodes: u64,
    /// Bytes freed by [`PrefixIndex::evict_lru`] since creation.
    pub evicted_bytes: u64,
    /// Nodes removed by TTL sweeps and instance removal since creation.
    pub expired_nodes: u64,
    /// Corrections from the engines' reports ([`PrefixIndex::trim`]) since creation.
    pub trims: u64,
    /// Blocks an instance was removed from by those corrections.
    pub trimmed_blocks: u64,
    /// Blocks instances were removed from because they held more than their engine's cache
    /// ([`PrefixIndex::evict_instance_to`]) since creation.
    pub capacity_evicted_blocks: u64,
}

/// The prefix index of one service. See the module documentation.
pub struct PrefixIndex {
    /// Each shard is the virtual root of a forest (its own `hashes`/`holders` stay empty).
    shards: Box<[RwLock<Node>]>,
    /// The TTL in ticks.
    ttl_ticks: AtomicU64,
    c: Counters,
    /// Blocks each instance holds by this index (Σ edge lengths of the nodes listing it): the
    /// size of its part of the tree, kept in step with every holder added or removed.
    held: RwLock<HashMap<InstanceKey, AtomicI64>>,
    /// Blocks each instance was removed from by its cache-size bound
    /// ([`PrefixIndex::evict_instance_to`]) since it joined: with `held`, what the gateway has
    /// placed there ([`PrefixIndex::placed_blocks`]).
    forgotten: RwLock<HashMap<InstanceKey, u64>>,
    /// Held while [`PrefixIndex::evict_instance_to`] runs: one at a time, so that two
    /// dispatches to a full instance do not walk the tree twice or count its removal twice.
    evicting: Mutex<()>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::new(PrefixIndexConfig::default())
    }
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("shards", &self.shards.len())
            .field("ttl_ms", &self.ttl_ms())
            .field("gauges", &self.gauges())
            .finish()
    }
}

/// The unit of last-use times: fine enough to order the requests one instance gets by age
/// (least recently used eviction), coarse enough that a `u32` lasts 13 years of uptime.
pub const TICK_MS: u64 = 100;

fn tick(now_ms: u64) -> u32 {
    (now_ms / TICK_MS).min(u64::from(u32::MAX)) as u32
}

fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixIndex {
    pub fn new(cfg: PrefixIndexConfig) -> Self {
        let n = shard_count(cfg.shards);
        PrefixIndex {
            shards: (0..n).map(|_| RwLock::new(Node::default())).collect(),
            ttl_ticks: AtomicU64::new(cfg.ttl_ms.div_ceil(TICK_MS)),
            c: Counters::default(),
            held: RwLock::default(),
            forgotten: RwLock::default(),
            evicting: Mutex::new(()),
        }
    }

    /// Blocks `key` holds by this index: what the gateway believes is in that instance's
    /// cache (dispatched prompts, less what expired, was evicted from the index or was
    /// trimmed after the engine reported less).
    pub fn held_blocks(&self, key: InstanceKey) -> u64 {
        self.held
            .read()
            .get(&key)
            .map_or(0, |b| b.load(Relaxed).max(0) as u64)
    }

    /// Blocks placed on `key`: what it holds by this index ([`held_blocks`](Self::held_blocks))
    /// plus what its cache-size bound made the index forget
    /// ([`evict_instance_to`](Self::evict_instance_to)). Without a bound the two are equal.
    /// With one, every busy instance's held blocks sit at its cache size and no longer tell
    /// instances apart, while the placed blocks still say how much distinct work each one has
    /// been given (a prompt placed again after the bound forgot it counts again: its engine
    /// computed it again). Engine-reported evictions ([`trim`](Self::trim)), expiry and
    /// memory eviction lower both alike; an instance that leaves the service starts from zero
    /// when it comes back ([`remove_instance`](Self::remove_instance)).
    pub fn placed_blocks(&self, key: InstanceKey) -> u64 {
        let forgotten = self.forgotten.read().get(&key).copied().unwrap_or(0);
        self.held_blocks(key) + forgotten
    }

    fn add_held(&self, key: InstanceKey, blocks: i64) {
        if blocks == 0 {
            return;
        }
        if let Some(b) = self.held.read().get(&key) {
            b.fetch_add(blocks, Relaxed);
            return;
        }
        self.held
            .write()
            .entry(key)
            .or_default()
            .fetch_add(blocks, Relaxed);
    }

    /// Takes every holder of `n` and its subtree off the per-instance counts (the subtree is
    /// being removed).
    fn release_subtree(&self, n: &Node) {
        let mut stack = vec![n];
        while let Some(n) = stack.pop() {
            for h in &n.holders {
                self.add_held(h.key, -(n.hashes.len() as i64));
            }
            stack.extend(n.children.values());
        }
    }

    /// Changes the entry lifetime in place (a config reload).
    pub fn set_ttl_ms(&self, ttl_ms: u64) {
        self.ttl_ticks.store(ttl_ms.div_ceil(TICK_MS), Relaxed);
    }

    /// The entry lifetime, milliseconds (rounded up to whole ticks, [`TICK_MS`]).
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ticks.load(Relaxed) * TICK_MS
    }

    fn shard(&self, first: u64) -> &RwLock<Node> {
        &self.shards[shard_of(first, self.shards.len())]
    }

    fn expired(&self, ts: u32, now: u32) -> bool {
        u64::from(ts) + self.ttl_ticks.load(Relaxed) < u64::from(now)
    }

    /// Matches a prompt's block hashes: for every instance, how many leading blocks it
    /// holds (holders idle for longer than the TTL are ignored). Read lock only.
    pub fn match_prefix(&self, hashes: &[u64], now_ms: u64) -> PrefixMatch {
        let mut out = PrefixMatch {
            prompt_blocks: hashes.len() as u32,
            ..PrefixMatch::default()
        };
        let Some(&first) = hashes.first() else {
            return out;
        };
        let now = tick(now_ms);
        let shard = self.shard(first).read();
        let mut node: &Node = &shard;
        let mut pos = 0;
        while pos < hashes.len() {
            let Some(child) = node.children.get(&hashes[pos]) else {
                break;
            };
            let m = common_prefix(&child.hashes, &hashes[pos..]);
            pos += m;
            let mut any = false;
            for h in &child.holders {
                if self.expired(h.ts(), now) {
                    continue;
                }
                any = true;
                match out.per_instance.iter_mut().find(|(k, _)| *k == h.key) {
                    Some(e) => e.1 = pos as u32,
                    None => out.per_instance.push((h.key, pos as u32)),
                }
            }
            if !any || m < child.hashes.len() {
                break;
            }
            node = child;
        }
        out.best = out.per_instance.iter().map(|e| e.1).max().unwrap_or(0);
        out
    }

    /// Records that `key` now holds the prompt `hashes` (call on dispatch). Takes only a read
    /// lock when the path already exists for `key`.
    pub fn insert(&self, hashes: &[u64], key: InstanceKey, now_ms: u64) {
        let Some(&first) = hashes.first() else {
            return;
        };
        let now = tick(now_ms);
        let lock = self.shard(first);
        if Self::refresh_path(&lock.read(), hashes, key, now) == hashes.len() {
            return;
        }
        self.insert_locked(&mut lock.write(), hashes, key, now);
    }

    /// Refreshes the last-use time of `key` along the prompt's path without adding anything
    /// (call on completion). Returns how many leading blocks were refreshed.
    pub fn touch(&self, hashes: &[u64], key: InstanceKey, now_ms: u64) -> usize {
        let Some(&first) = hashes.first() else {
            return 0;
        };
        Self::refresh_path(&self.shard(first).read(), hashes, key, tick(now_ms))
    }

    /// Walks the path while every node lists `key`, bumping its timestamp; returns the blocks
    /// covered (`hashes.len()` when the whole prompt is already held by `key`).
    fn refresh_path(root: &Node, hashes: &[u64], key: InstanceKey, now: u32) -> usize {
        let mut node = root;
        let mut pos = 0;
        while pos < hashes.len() {
            let Some(child) = node.children.get(&hashes[pos]) else {
                break;
            };
            let Some(h) = child.holder(key) else {
                break;
            };
            let m = common_prefix(&child.hashes, &hashes[pos..]);
            // A prompt that leaves the edge part-way did not use its tail: the insert that
            // follows splits the edge and stamps the common part only (so that least recently
            // used stays true per block for `evict_instance_to`).
            if m == child.hashes.len() || pos + m == hashes.len() {
                h.ts.fetch_max(now, Relaxed);
            }
            pos += m;
            if m < child.hashes.len() {
                // Diverged inside the edge: only the common part counts; if the prompt simply
                // ended inside the edge, `pos == hashes.len()` and the prompt is covered.
                break;
            }
            node = child;
        }
        pos
    }

    fn insert_locked(&self, root: &mut Node, hashes: &[u64], key: InstanceKey, now: u32) {
        let mut node = root;
        let mut pos = 0;
        while pos < hashes.len() {
            match node.children.entry(hashes[pos]) {
                Entry::Vacant(v) => {
                    let leaf = Node {
                        hashes: hashes[pos..].to_vec(),
                        holders: vec![Holder::new(key, now)],
                        children: HashMap::default(),
                    };
                    self.c.add(1, leaf.hashes.len() as i64, leaf.cost());
                    self.add_held(key, leaf.hashes.len() as i64);
                    v.insert(leaf);
                    return;
                }
                Entry::Occupied(o) => {
                    let child = o.into_mut();
                    let m = common_prefix(&child.hashes, &hashes[pos..]);
                    if m < child.hashes.len() {
                        self.split(child, m);
                    }
                    match child.holder(key) {
                        Some(h) => {
                            h.ts.fetch_max(now, Relaxed);
                        }
                        None => {
                            child.holders.push(Holder::new(key, now));
                            self.c.add(0, 0, HOLDER_BYTES);
                            self.add_held(key, child.hashes.len() as i64);
                        }
                    }
                    pos += m;
                    node = child;
                }
            }
        }
    }

    /// Splits `n`'s edge after `m` blocks (0 < m < len): the rest moves to a single child
    /// that inherits the holders and the children.
    fn split(&self, n: &mut Node, m: usize) {
        let lower_hashes = n.hashes.split_off(m);
        n.hashes.shrink_to_fit();
        let lower = Node {
            hashes: lower_hashes,
            holders: n.holders.clone(),
            children: mem::take(&mut n.children),
        };
        // The moved blocks were already counted in `n`.
        self.c
            .add(1, 0, lower.cost() - 8 * lower.hashes.len() as i64);
        n.children.insert(lower.hashes[0], lower);
    }

    /// Approximate heap bytes held: 8 per cached block, 16 per holder, and per node its
    /// struct in the parent's hash table (with load-factor slack) plus allocator headers.
    pub fn approx_bytes(&self) -> u64 {
        self.c.bytes.load(Relaxed).max(0) as u64
    }

    /// Current gauges and counters.
    pub fn gauges(&self) -> IndexGauges {
        IndexGauges {
            nodes: self.c.nodes.load(Relaxed).max(0) as u64,
            blocks: self.c.blocks.load(Relaxed).max(0) as u64,
            bytes: self.approx_bytes(),
            evicted_nodes: self.c.evicted_nodes.load(Relaxed),
            evicted_bytes: self.c.evicted_bytes.load(Relaxed),
            expired_nodes: self.c.expired_nodes.load(Relaxed),
            trims: self.c.trims.load(Relaxed),
            trimmed_blocks: self.c.trimmed_blocks.load(Relaxed),
            capacity_evicted_blocks: self.c.capacity_evicted_blocks.load(Relaxed),
        }
    }
}
