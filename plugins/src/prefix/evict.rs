//! Taking entries out of the index: engine-reported corrections ([`PrefixIndex::trim`]), an
//! instance's cache-size bound, instance removal, TTL sweeps and least-recently-used eviction
//! under a memory bound, all through one top-down [`PrefixIndex::prune`] walk.

use std::sync::atomic::Ordering::Relaxed;

use super::node::{Holder, Node, Totals, HOLDER_BYTES};
use super::{common_prefix, tick, PrefixIndex};
use crate::hash::InstanceKey;

impl PrefixIndex {
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
}
