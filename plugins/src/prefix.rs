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
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering::Relaxed};

use parking_lot::{Mutex, RwLock};

use crate::hash::{shard_count, shard_of, InstanceKey, PreHashed};

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

struct Holder {
    key: InstanceKey,
    /// Last use, in ticks of [`TICK_MS`] (the caller's clock / 100).
    ts: AtomicU32,
}

impl Holder {
    fn new(key: InstanceKey, ts: u32) -> Self {
        Holder {
            key,
            ts: AtomicU32::new(ts),
        }
    }
    fn ts(&self) -> u32 {
        self.ts.load(Relaxed)
    }
}

impl Clone for Holder {
    fn clone(&self) -> Self {
        Holder::new(self.key, self.ts())
    }
}

#[derive(Default)]
struct Node {
    /// The edge: chained block hashes; `hashes[0]` is this node's key in its parent's map.
    hashes: Vec<u64>,
    holders: Vec<Holder>,
    children: HashMap<u64, Node, PreHashed>,
}

/// Bytes one holder costs.
const HOLDER_BYTES: i64 = size_of::<Holder>() as i64;
/// Fixed bytes of a node: its slot in the parent's hash table (at hashbrown's 7/8 max load
/// factor, +1 control byte) and the allocator headers of its two vectors.
const NODE_BASE: i64 = (size_of::<(u64, Node)>() * 8 / 7 + 1 + 2 * 16) as i64;

impl Node {
    fn cost(&self) -> i64 {
        node_cost(self.hashes.len(), self.holders.len())
    }
    fn max_ts(&self) -> u32 {
        self.holders.iter().map(Holder::ts).max().unwrap_or(0)
    }
    fn holder(&self, key: InstanceKey) -> Option<&Holder> {
        self.holders.iter().find(|h| h.key == key)
    }
}

fn node_cost(blocks: usize, holders: usize) -> i64 {
    NODE_BASE + 8 * blocks as i64 + HOLDER_BYTES * holders as i64
}

impl Drop for Node {
    /// Iterative, so that a pathologically deep tree cannot overflow the stack.
    fn drop(&mut self) {
        if self.children.is_empty() {
            return;
        }
        let mut stack: Vec<Node> = self.children.drain().map(|(_, n)| n).collect();
        while let Some(mut n) = stack.pop() {
            stack.extend(n.children.drain().map(|(_, c)| c));
        }
    }
}

#[derive(Default)]
struct Counters {
    nodes: AtomicI64,
    blocks: AtomicI64,
    bytes: AtomicI64,
    evicted_nodes: AtomicU64,
    evicted_bytes: AtomicU64,
    expired_nodes: AtomicU64,
    trims: AtomicU64,
    trimmed_blocks: AtomicU64,
    capacity_evicted_blocks: AtomicU64,
}

impl Counters {
    fn add(&self, nodes: i64, blocks: i64, bytes: i64) {
        if nodes != 0 {
            self.nodes.fetch_add(nodes, Relaxed);
        }
        if blocks != 0 {
            self.blocks.fetch_add(blocks, Relaxed);
        }
        if bytes != 0 {
            self.bytes.fetch_add(bytes, Relaxed);
        }
    }
}

/// Totals of a removed subtree.
#[derive(Clone, Copy, Default)]
struct Totals {
    nodes: i64,
    blocks: i64,
    bytes: i64,
}

impl Totals {
    fn of(n: &Node) -> Totals {
        let mut t = Totals::default();
        let mut stack = vec![n];
        while let Some(n) = stack.pop() {
            t.nodes += 1;
            t.blocks += n.hashes.len() as i64;
            t.bytes += n.cost();
            stack.extend(n.children.values());
        }
        t
    }
    fn add(&mut self, o: Totals) {
        self.nodes += o.nodes;
        self.blocks += o.blocks;
        self.bytes += o.bytes;
    }
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

    /// Applies `keep_holder` top-down to every node (a node's holders are also restricted to
    /// its parent's, keeping the subset invariant) and removes nodes left without holders,
    /// or for which `keep_node` says no, with their subtrees. Returns what was removed.
    fn prune(
        &self,
        keep_holder: impl Fn(&Holder) -> bool,
        keep_node: impl Fn(&Node) -> bool,
    ) -> Totals {
        let mut removed = Totals::default();
        for shard in self.shards.iter() {
            let mut root = shard.write();
            let mut stack: Vec<&mut Node> = vec![&mut root];
            let mut is_root = true;
            while let Some(n) = stack.pop() {
                let Node {
                    holders, children, ..
                } = n;
                let parent: &Vec<Holder> = holders;
                children.retain(|_, c| {
                    let before = c.holders.len();
                    let len = c.hashes.len() as i64;
                    c.holders.retain(|h| {
                        let keep =
                            keep_holder(h) && (is_root || parent.iter().any(|p| p.key == h.key));
                        if !keep {
                            self.add_held(h.key, -len);
                        }
                        keep
                    });
                    let dropped = (before - c.holders.len()) as i64;
                    if dropped > 0 {
                        self.c.add(0, 0, -dropped * HOLDER_BYTES);
                    }
                    if c.holders.is_empty() || !keep_node(c) {
                        self.release_subtree(c);
                        let t = Totals::of(c);
                        removed.add(t);
                        self.c.add(-t.nodes, -t.blocks, -t.bytes);
                        false
                    } else {
                        true
                    }
                });
                is_root = false;
                stack.extend(children.values_mut());
            }
        }
        removed
    }

    /// Corrects the index from what an engine reported: `key` held only the first `keep`
    /// blocks of the prompt `hashes` (its `cached_tokens`), so whatever the index lists for
    /// `key` below that depth on this path was evicted by the engine: `key` is removed from
    /// the path's node at depth `keep` and its whole subtree (other prompts' tails that branch
    /// off deeper cannot be cached without the blocks they extend). An edge that crosses
    /// `keep` is split there. Returns the blocks `key` was removed from.
    ///
    /// The engine has just recomputed the prompt, so a caller that trims after a completed
    /// request inserts the prompt again afterwards.
    pub fn trim(&self, hashes: &[u64], key: InstanceKey, keep: usize) -> u64 {
        if keep >= hashes.len() {
            return 0;
        }
        let Some(&first) = hashes.first() else {
            return 0;
        };
        let mut root = self.shard(first).write();
        let mut node: &mut Node = &mut root;
        let mut pos = 0;
        // Walk down to the node whose edge starts at depth `keep` (splitting one that crosses
        // it), as long as `key` holds the path.
        while pos < keep {
            let Some(child) = node.children.get_mut(&hashes[pos]) else {
                return 0;
            };
            if child.holder(key).is_none() {
                return 0;
            }
            let m = common_prefix(&child.hashes, &hashes[pos..]);
            if keep < pos + child.hashes.len() {
                if keep - pos > m {
                    return 0; // the prompt leaves this edge before `keep`
                }
                self.split(child, keep - pos);
            } else if m < child.hashes.len() {
                return 0;
            }
            pos += child.hashes.len();
            node = child;
        }
        // `node.children[hashes[keep]]` starts at depth `keep`: drop `key` from its subtree.
        let Some(top) = node.children.get_mut(&hashes[pos]) else {
            return 0;
        };
        if top.holder(key).is_none() {
            return 0;
        }
        let mut blocks = 0u64;
        let mut stack: Vec<&mut Node> = vec![top];
        let mut top_empty = false;
        let mut first_node = true;
        while let Some(n) = stack.pop() {
            if let Some(i) = n.holders.iter().position(|h| h.key == key) {
                n.holders.swap_remove(i);
                self.c.add(0, 0, -HOLDER_BYTES);
                self.add_held(key, -(n.hashes.len() as i64));
                blocks += n.hashes.len() as u64;
            }
            if first_node {
                top_empty = n.holders.is_empty();
                first_node = false;
            }
            if n.holders.is_empty() {
                continue; // removed with its subtree below
            }
            n.children.retain(|_, c| {
                if c.holders.len() == 1 && c.holders[0].key == key {
                    self.release_subtree(c);
                    let t = Totals::of(c);
                    blocks += t.blocks as u64;
                    self.c.add(-t.nodes, -t.blocks, -t.bytes);
                    false
                } else {
                    true
                }
            });
            stack.extend(n.children.values_mut());
        }
        if top_empty {
            if let Some(t) = node.children.remove(&hashes[pos]) {
                self.release_subtree(&t);
                let t = Totals::of(&t);
                self.c.add(-t.nodes, -t.blocks, -t.bytes);
            }
        }
        self.c.trims.fetch_add(1, Relaxed);
        self.c.trimmed_blocks.fetch_add(blocks, Relaxed);
        blocks
    }

    /// Bounds what the index believes `key` holds by its engine's cache: removes `key` from
    /// its least recently used entries (whole ticks of last use, oldest first; a prompt's
    /// deeper blocks are never newer than its shallower ones, so tails go first) until it
    /// holds at most `target` blocks — what the engine's own LRU eviction has done by then.
    /// Entries used in the newest tick always stay (they were just dispatched: the engine
    /// holds them or is computing them), so it may stop above `target`. Returns the blocks
    /// removed (less what concurrent inserts added meanwhile). Walks the tree: call it when
    /// `key` is over its capacity, with `target` a little below it so that it does not run on
    /// every request. One runs at a time per index: a call while another runs does nothing
    /// and returns 0.
    pub fn evict_instance_to(&self, key: InstanceKey, target: u64) -> u64 {
        // Another eviction under way: it leaves this one for the next dispatch, if still due.
        let Some(_one_at_a_time) = self.evicting.try_lock() else {
            return 0;
        };
        let held = self.held_blocks(key);
        if held <= target {
            return 0;
        }
        let excess = held - target;
        let mut per_tick: std::collections::BTreeMap<u32, u64> = Default::default();
        self.for_each_node(|n| {
            if let Some(h) = n.holder(key) {
                *per_tick.entry(h.ts()).or_default() += n.hashes.len() as u64;
            }
        });
        // The first tick whose entries stay: after the oldest ticks that add up to the
        // excess, and never after the newest.
        let newest = per_tick.keys().next_back().copied().unwrap_or(0);
        let mut cutoff = newest;
        let mut acc = 0;
        for (ts, blocks) in &per_tick {
            acc += blocks;
            if acc >= excess {
                cutoff = ts.saturating_add(1).min(newest);
                break;
            }
        }
        self.prune(|h| h.key != key || h.ts() >= cutoff, |_| true);
        let removed = held.saturating_sub(self.held_blocks(key));
        self.c.capacity_evicted_blocks.fetch_add(removed, Relaxed);
        // Rare (once per 5 % of a cache that turns over) and one at a time: a plain write.
        *self.forgotten.write().entry(key).or_default() += removed;
        removed
    }

    /// Drops every entry of an instance (it left the service), and its held- and placed-blocks
    /// counts.
    /// Returns the nodes removed.
    pub fn remove_instance(&self, key: InstanceKey) -> u64 {
        let t = self.prune(|h| h.key != key, |_| true);
        self.c.expired_nodes.fetch_add(t.nodes as u64, Relaxed);
        self.held.write().remove(&key);
        self.forgotten.write().remove(&key);
        t.nodes as u64
    }

    /// Drops holders idle for longer than the TTL and frees nodes left without holders.
    /// Returns the nodes removed.
    pub fn sweep_expired(&self, now_ms: u64) -> u64 {
        let now = tick(now_ms);
        let t = self.prune(|h| !self.expired(h.ts(), now), |_| true);
        self.c.expired_nodes.fetch_add(t.nodes as u64, Relaxed);
        t.nodes as u64
    }

    /// Frees at least `bytes_to_free` bytes (as counted by [`approx_bytes`](Self::approx_bytes))
    /// by removing the least recently used nodes — whole time buckets of a 1024-bucket
    /// histogram of last-use times, so usually somewhat more. Returns the bytes freed.
    pub fn evict_lru(&self, bytes_to_free: u64) -> u64 {
        if bytes_to_free == 0 {
            return 0;
        }
        // Pass 1: the time range.
        let (mut lo, mut hi) = (u32::MAX, 0u32);
        self.for_each_node(|n| {
            let t = n.max_ts();
            lo = lo.min(t);
            hi = hi.max(t);
        });
        if lo > hi {
            return 0;
        }
        // Pass 2: bytes per time bucket.
        const BUCKETS: u64 = 1024;
        let span = u64::from(hi - lo) + 1;
        let mut hist = vec![0i64; BUCKETS as usize];
        self.for_each_node(|n| {
            let t = n.max_ts().clamp(lo, hi);
            hist[(u64::from(t - lo) * BUCKETS / span) as usize] += n.cost();
        });
        let mut acc = 0i64;
        let mut cutoff = u64::from(hi) + 1;
        for (b, bytes) in hist.iter().enumerate() {
            acc += bytes;
            if acc >= bytes_to_free as i64 {
                cutoff = u64::from(lo) + ((b as u64 + 1) * span).div_ceil(BUCKETS);
                break;
            }
        }
        // Pass 3: remove nodes last used before the cut-off (always whole path bottoms, as a
        // node's time is ≥ its children's).
        let t = self.prune(|_| true, |n| u64::from(n.max_ts()) >= cutoff);
        self.c.evicted_nodes.fetch_add(t.nodes as u64, Relaxed);
        self.c.evicted_bytes.fetch_add(t.bytes as u64, Relaxed);
        t.bytes as u64
    }

    /// Evicts least recently used nodes until [`approx_bytes`](Self::approx_bytes) is at
    /// most `target_bytes`. Returns the bytes freed.
    pub fn evict_to(&self, target_bytes: u64) -> u64 {
        let now = self.approx_bytes();
        if now <= target_bytes {
            0
        } else {
            self.evict_lru(now - target_bytes)
        }
    }

    fn for_each_node(&self, mut f: impl FnMut(&Node)) {
        for shard in self.shards.iter() {
            let root = shard.read();
            let mut stack: Vec<&Node> = root.children.values().collect();
            while let Some(n) = stack.pop() {
                f(n);
                stack.extend(n.children.values());
            }
        }
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

    /// Recounts nodes/blocks/bytes by walking the trees and checks the structural
    /// invariants (tests and debugging; takes every shard's read lock in turn).
    pub fn audit(&self) -> Result<(u64, u64, u64), String> {
        let mut t = Totals::default();
        let mut held: HashMap<InstanceKey, i64> = HashMap::new();
        for shard in self.shards.iter() {
            let root = shard.read();
            let mut stack: Vec<(&Node, Option<&Node>)> =
                root.children.values().map(|c| (c, None)).collect();
            while let Some((n, parent)) = stack.pop() {
                t.add(Totals {
                    nodes: 1,
                    blocks: n.hashes.len() as i64,
                    bytes: n.cost(),
                });
                if n.hashes.is_empty() || n.holders.is_empty() {
                    return Err("empty edge or holder list".into());
                }
                for h in &n.holders {
                    *held.entry(h.key).or_default() += n.hashes.len() as i64;
                }
                if let Some(p) = parent {
                    for h in &n.holders {
                        match p.holder(h.key) {
                            None => return Err(format!("{:?} not in parent", h.key)),
                            Some(ph) if ph.ts() < h.ts() => {
                                return Err(format!("{:?} newer than in parent", h.key))
                            }
                            _ => {}
                        }
                    }
                }
                for (k, c) in &n.children {
                    if c.hashes[0] != *k {
                        return Err("child key mismatch".into());
                    }
                    stack.push((c, Some(n)));
                }
            }
        }
        for (k, b) in self.held.read().iter() {
            let want = held.get(k).copied().unwrap_or(0);
            if b.load(Relaxed) != want {
                return Err(format!(
                    "{k:?} counted {} blocks, holds {want}",
                    b.load(Relaxed)
                ));
            }
        }
        if let Some(k) = held.keys().find(|k| !self.held.read().contains_key(k)) {
            return Err(format!("{k:?} holds blocks but is not counted"));
        }
        Ok((t.nodes as u64, t.blocks as u64, t.bytes as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn k(i: u64) -> InstanceKey {
        InstanceKey(i)
    }
    fn seq(range: std::ops::Range<u64>) -> Vec<u64> {
        range.collect()
    }
    fn idx() -> PrefixIndex {
        PrefixIndex::new(PrefixIndexConfig {
            ttl_ms: 50_000,
            shards: 4,
        })
    }
    fn check(ix: &PrefixIndex) {
        let (nodes, blocks, bytes) = ix.audit().expect("invariants");
        let g = ix.gauges();
        assert_eq!((g.nodes, g.blocks, g.bytes), (nodes, blocks, bytes));
    }

    #[test]
    fn per_instance_match_lengths_with_splits() {
        let ix = idx();
        let a = seq(1..11); // 10 blocks
        let mut b = seq(1..6);
        b.push(99); // shares 5 blocks with a
        ix.insert(&a, k(1), 0);
        ix.insert(&b, k(2), 0);
        let m = ix.match_prefix(&a, 0);
        assert_eq!((m.prompt_blocks, m.best), (10, 10));
        assert_eq!(m.matched(k(1)), 10);
        assert_eq!(m.matched(k(2)), 5);
        assert_eq!(m.matched(k(3)), 0);
        assert!((m.ratio(k(2)) - 0.5).abs() < 1e-12);
        let m = ix.match_prefix(&b, 0);
        assert_eq!((m.matched(k(1)), m.matched(k(2)), m.best), (5, 6, 6));
        // A prompt that diverges inside an edge / ends inside an edge.
        let mut c = seq(1..4);
        c.push(1234);
        let m = ix.match_prefix(&c, 0);
        assert_eq!((m.matched(k(1)), m.matched(k(2))), (3, 3));
        let m = ix.match_prefix(&seq(1..3), 0);
        assert_eq!((m.matched(k(1)), m.best, m.prompt_blocks), (2, 2, 2));
        assert_eq!(
            ix.match_prefix(&[42, 43], 0),
            PrefixMatch {
                prompt_blocks: 2,
                ..Default::default()
            }
        );
        check(&ix);
        assert_eq!(ix.gauges().blocks, 11);
    }

    #[test]
    fn a_shorter_prompt_splits_and_lists_only_its_part() {
        let ix = idx();
        ix.insert(&seq(1..11), k(1), 0);
        ix.insert(&seq(1..5), k(2), 0);
        let m = ix.match_prefix(&seq(1..11), 0);
        assert_eq!((m.matched(k(1)), m.matched(k(2))), (10, 4));
        assert_eq!(ix.gauges().nodes, 2);
        // Re-inserting an existing path is a pure refresh.
        let before = ix.gauges();
        ix.insert(&seq(1..11), k(1), 1000);
        ix.insert(&seq(1..3), k(2), 1000);
        assert_eq!(ix.gauges(), before);
        check(&ix);
    }

    #[test]
    fn ttl_ignores_then_sweeps_idle_holders() {
        let ix = idx(); // ttl 50 s
        ix.insert(&seq(1..9), k(1), 0);
        ix.insert(&seq(1..5), k(2), 0);
        ix.touch(&seq(1..9), k(1), 40_000); // refreshed
                                            // At 60 s: k2 (last use 0 s) is stale, k1 (40 s) is fresh.
        let m = ix.match_prefix(&seq(1..9), 60_000);
        assert_eq!((m.matched(k(1)), m.matched(k(2))), (8, 0));
        assert_eq!(ix.sweep_expired(60_000), 0); // k2 only held a shared node: nothing freed
        check(&ix);
        assert_eq!(ix.match_prefix(&seq(1..9), 60_000).per_instance.len(), 1);
        // At 100 s everything is stale.
        assert_eq!(ix.match_prefix(&seq(1..9), 100_000).best, 0);
        assert_eq!(ix.sweep_expired(100_000), 2);
        assert_eq!(ix.gauges().nodes, 0);
        assert_eq!(ix.gauges().bytes, 0);
        assert_eq!(ix.gauges().expired_nodes, 2);
    }

    #[test]
    fn held_blocks_follow_every_insert_split_trim_sweep_and_removal() {
        let ix = idx(); // ttl 50 s
        ix.insert(&seq(1..9), k(1), 0); // k1: 8
        ix.insert(&seq(1..5), k(2), 0); // splits the edge; k2: 4
        ix.insert(&seq(100..110), k(2), 0); // k2: 14
        ix.insert(&seq(1..9), k(1), 0); // a refresh adds nothing
        assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (8, 14));
        assert_eq!(ix.held_blocks(k(3)), 0);
        check(&ix);
        // The engine k1 reported only 2 cached blocks of 1..9: it lost the other 6.
        assert_eq!(ix.trim(&seq(1..9), k(1), 2), 6);
        assert_eq!(ix.held_blocks(k(1)), 2);
        check(&ix);
        // k2's 100..110 goes stale; k1 refreshed 1..3 at 40 s.
        ix.touch(&seq(1..3), k(1), 40_000);
        ix.touch(&seq(1..5), k(2), 40_000);
        ix.sweep_expired(60_000);
        assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (2, 4));
        check(&ix);
        ix.remove_instance(k(2));
        assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (2, 0));
        check(&ix);
        ix.evict_to(0);
        assert_eq!(ix.held_blocks(k(1)), 0);
        check(&ix);
    }

    #[test]
    fn an_instance_over_its_capacity_loses_its_least_recently_used_entries_first() {
        let ix = idx();
        let b: Vec<u64> = seq(1..5).into_iter().chain(seq(20..26)).collect();
        ix.insert(&seq(1..9), k(1), 0); // A at 0 s: 8 blocks
        ix.insert(&seq(1..9), k(2), 0); // k2 holds A too
        ix.insert(&b, k(1), 1_000); // B at 1 s shares A's first 4 (refreshed) and adds 6
        ix.insert(&seq(50..60), k(1), 2_000); // C at 2 s: 10
        assert_eq!(ix.held_blocks(k(1)), 24);
        // Under the target: nothing to do.
        assert_eq!(ix.evict_instance_to(k(1), 24), 0);
        // 4 over: A's tail (last used at 0 s) goes; k2 keeps all of A.
        assert_eq!(ix.evict_instance_to(k(1), 20), 4);
        let a = ix.match_prefix(&seq(1..9), 2_000);
        assert_eq!((a.matched(k(1)), a.matched(k(2))), (4, 8));
        check(&ix);
        // 8 over: the whole tick of 1 s goes (B, and the shared prefix under it); C stays.
        assert_eq!(ix.evict_instance_to(k(1), 12), 10);
        assert_eq!(ix.match_prefix(&b, 2_000).matched(k(1)), 0);
        assert_eq!(ix.match_prefix(&seq(50..60), 2_000).matched(k(1)), 10);
        assert_eq!(ix.held_blocks(k(2)), 8);
        assert_eq!(ix.gauges().capacity_evicted_blocks, 14);
        check(&ix);
        // What was used in the newest tick stays, even over the target: D lands 50 ms after
        // C, in the same tick.
        ix.insert(&seq(70..80), k(1), 2_050);
        assert_eq!(ix.evict_instance_to(k(1), 5), 0);
        assert_eq!(ix.held_blocks(k(1)), 20);
        // A tick later C and D are the oldest: both go, E stays.
        ix.insert(&seq(90..95), k(1), 2_100);
        assert_eq!(ix.evict_instance_to(k(1), 5), 20);
        assert_eq!(ix.held_blocks(k(1)), 5);
        check(&ix);
        // What the bound forgot still counts as placed there (4 + 10 + 20 blocks); k2 was
        // never bounded; an engine-reported eviction lowers both; leaving the service resets.
        assert_eq!(ix.placed_blocks(k(1)), 5 + 34);
        assert_eq!(ix.placed_blocks(k(2)), ix.held_blocks(k(2)));
        assert_eq!(ix.trim(&seq(90..95), k(1), 2), 3);
        assert_eq!((ix.held_blocks(k(1)), ix.placed_blocks(k(1))), (2, 36));
        ix.remove_instance(k(1));
        assert_eq!(ix.placed_blocks(k(1)), 0);
        // One eviction at a time: while another runs, a call does nothing.
        ix.insert(&seq(100..110), k(2), 3_000);
        let running = ix.evicting.lock();
        assert_eq!(ix.evict_instance_to(k(2), 5), 0);
        drop(running);
        assert!(ix.evict_instance_to(k(2), 5) > 0);
        assert_eq!(ix.held_blocks(k(2)), 10);
        check(&ix);
    }

    #[test]
    fn touch_refreshes_only_what_the_instance_holds() {
        let ix = idx();
        ix.insert(&seq(1..9), k(1), 0);
        assert_eq!(ix.touch(&seq(1..9), k(1), 1000), 8);
        assert_eq!(ix.touch(&seq(1..5), k(1), 1000), 4);
        assert_eq!(ix.touch(&seq(1..9), k(2), 1000), 0);
        assert_eq!(ix.touch(&[77], k(1), 1000), 0);
        assert_eq!(ix.gauges().nodes, 1);
    }

    #[test]
    fn remove_instance_keeps_the_others() {
        let ix = idx();
        ix.insert(&seq(1..9), k(1), 0);
        ix.insert(&seq(1..5), k(2), 0);
        ix.insert(&seq(100..110), k(2), 0);
        assert_eq!(ix.remove_instance(k(2)), 1);
        let m = ix.match_prefix(&seq(1..9), 0);
        assert_eq!((m.matched(k(1)), m.matched(k(2))), (8, 0));
        assert_eq!(ix.match_prefix(&seq(100..110), 0).best, 0);
        check(&ix);
        // Its held-blocks count goes too (instance ids churn: pods come and go).
        assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (8, 0));
        assert!(!ix.held.read().contains_key(&k(2)));
        ix.remove_instance(k(1));
        assert_eq!(ix.gauges().nodes, 0);
        assert_eq!(ix.gauges().bytes, 0);
        assert!(ix.held.read().is_empty());
    }

    #[test]
    fn lru_eviction_frees_the_oldest_first() {
        let ix = idx();
        for i in 0..100u64 {
            // Ten blocks each, distinct first blocks, one per second.
            ix.insert(&seq(i * 1000..i * 1000 + 10), k(i % 3), i * 1000);
        }
        check(&ix);
        let total = ix.approx_bytes();
        let freed = ix.evict_lru(total / 4);
        assert!(freed >= total / 4, "{freed} < {}", total / 4);
        assert!(
            freed < total / 2,
            "evicted far too much: {freed} of {total}"
        );
        assert_eq!(ix.approx_bytes(), total - freed);
        // Oldest gone, newest present.
        assert_eq!(ix.match_prefix(&seq(0..10), 100_000).best, 0);
        assert_eq!(ix.match_prefix(&seq(99_000..99_010), 100_000).best, 10);
        let g = ix.gauges();
        assert_eq!(g.evicted_bytes, freed);
        assert!(g.evicted_nodes >= 25);
        check(&ix);
        assert_eq!(ix.evict_to(0), total - freed);
        assert_eq!(ix.gauges().nodes, 0);
        assert_eq!(ix.evict_lru(10), 0);
    }

    #[test]
    fn eviction_cuts_path_bottoms_not_middles() {
        let ix = idx();
        ix.insert(&seq(1..5), k(1), 0); // old prefix …
        ix.insert(&seq(1..20), k(1), 100_000); // … refreshed by a longer, newer prompt
        ix.insert(&[1, 2, 3, 4, 500, 501], k(2), 10_000); // an old branch
        ix.evict_lru(1);
        // The old branch went; the refreshed path is intact.
        assert_eq!(ix.match_prefix(&seq(1..20), 100_000).matched(k(1)), 19);
        assert_eq!(ix.match_prefix(&[1, 2, 3, 4, 500, 501], 100_000).best, 4);
        check(&ix);
    }

    #[test]
    fn counters_match_a_recount_after_random_operations() {
        let ix = idx();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let systems: Vec<Vec<u64>> = (0..5)
            .map(|s| seq(s * 1_000_000..s * 1_000_000 + 8))
            .collect();
        for step in 0..3000u64 {
            let mut p = systems[rng.gen_range(0..5)].clone();
            p.truncate(rng.gen_range(1..9));
            for _ in 0..rng.gen_range(0..6) {
                p.push(rng.gen_range(0..20));
            }
            let now = step * 100;
            match rng.gen_range(0..100) {
                0..=79 => ix.insert(&p, k(rng.gen_range(0..4)), now),
                80..=89 => {
                    ix.touch(&p, k(rng.gen_range(0..4)), now);
                }
                90..=94 => {
                    ix.sweep_expired(now);
                }
                95..=97 => {
                    ix.evict_lru(ix.approx_bytes() / 10);
                }
                _ => {
                    ix.remove_instance(k(rng.gen_range(0..4)));
                }
            }
            if step % 100 == 0 {
                check(&ix);
            }
        }
        check(&ix);
    }

    #[test]
    fn concurrent_inserts_and_matches_stay_consistent() {
        let ix = PrefixIndex::default();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let ix = &ix;
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                    for i in 0..2000u64 {
                        let mut p = seq(0..rng.gen_range(1..16));
                        p.extend(seq(1000 + i..1000 + i + rng.gen_range(0..4)));
                        ix.insert(&p, k(t), i);
                        let m = ix.match_prefix(&p, i);
                        assert!(m.matched(k(t)) as usize <= p.len());
                    }
                });
            }
        });
        check(&ix);
    }

    #[test]
    fn a_deep_tree_is_dropped_without_recursion() {
        let ix = idx();
        let base = seq(1..3001);
        ix.insert(&base, k(1), 0);
        for d in 1..3000 {
            let mut p = base[..d].to_vec();
            p.push(1_000_000 + d as u64);
            ix.insert(&p, k(2), 0);
        }
        assert!(ix.gauges().nodes > 5000);
        check(&ix);
        drop(ix);
    }

    #[test]
    fn trimming_removes_what_the_engine_evicted_below_the_reported_depth() {
        let ix = idx();
        // Instance 1 served a system prompt (0..8) with two different tails; instance 2 the
        // first tail too.
        let a: Vec<u64> = seq(0..8).into_iter().chain(seq(100..108)).collect();
        let b: Vec<u64> = seq(0..8).into_iter().chain(seq(200..204)).collect();
        ix.insert(&a, k(1), 0);
        ix.insert(&b, k(1), 0);
        ix.insert(&a, k(2), 0);
        check(&ix);
        assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 16);
        // The engine behind instance 1 reports only 5 blocks of `a` cached: everything of
        // instance 1 below depth 5 on that path (both tails) is gone.
        let dropped = ix.trim(&a, k(1), 5);
        check(&ix);
        assert_eq!(dropped, 3 + 8 + 4);
        assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 5);
        assert_eq!(ix.match_prefix(&b, 0).matched(k(1)), 5);
        // Instance 2 is untouched.
        assert_eq!(ix.match_prefix(&a, 0).matched(k(2)), 16);
        assert_eq!(ix.gauges().trims, 1);
        // Re-inserting (the engine just recomputed `a`) restores it; trimming to 0 removes
        // instance 1 from the whole family; nodes nobody holds are freed.
        ix.insert(&a, k(1), 0);
        assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 16);
        ix.trim(&b, k(1), 0);
        check(&ix);
        assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 0);
        assert_eq!(ix.match_prefix(&a, 0).matched(k(2)), 16);
        ix.trim(&a, k(2), 0);
        check(&ix);
        assert_eq!(ix.gauges().nodes, 0, "{:?}", ix.gauges());
        // Nothing to trim: deeper than the prompt, or a path the instance does not hold.
        assert_eq!(ix.trim(&a, k(3), 2), 0);
        assert_eq!(ix.trim(&a, k(1), 99), 0);
    }
}
