//! The index's tree: nodes (an edge of block hashes, its holders, its children), what they
//! cost in memory, and the index's counters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering::Relaxed};

use crate::hash::{InstanceKey, PreHashed};

pub(super) struct Holder {
    pub(super) key: InstanceKey,
    /// Last use, in ticks of [`TICK_MS`](super::TICK_MS) (the caller's clock / 100).
    pub(super) ts: AtomicU32,
}

impl Holder {
    pub(super) fn new(key: InstanceKey, ts: u32) -> Self {
        Holder {
            key,
            ts: AtomicU32::new(ts),
        }
    }
    pub(super) fn ts(&self) -> u32 {
        self.ts.load(Relaxed)
    }
}

impl Clone for Holder {
    fn clone(&self) -> Self {
        Holder::new(self.key, self.ts())
    }
}

#[derive(Default)]
pub(super) struct Node {
    /// The edge: chained block hashes; `hashes[0]` is this node's key in its parent's map.
    pub(super) hashes: Vec<u64>,
    pub(super) holders: Vec<Holder>,
    pub(super) children: HashMap<u64, Node, PreHashed>,
}

/// Bytes one holder costs.
pub(super) const HOLDER_BYTES: i64 = size_of::<Holder>() as i64;
/// Fixed bytes of a node: its slot in the parent's hash table (at hashbrown's 7/8 max load
/// factor, +1 control byte) and the allocator headers of its two vectors.
pub(super) const NODE_BASE: i64 = (size_of::<(u64, Node)>() * 8 / 7 + 1 + 2 * 16) as i64;

impl Node {
    pub(super) fn cost(&self) -> i64 {
        node_cost(self.hashes.len(), self.holders.len())
    }
    pub(super) fn max_ts(&self) -> u32 {
        self.holders.iter().map(Holder::ts).max().unwrap_or(0)
    }
    pub(super) fn holder(&self, key: InstanceKey) -> Option<&Holder> {
        self.holders.iter().find(|h| h.key == key)
    }
}

pub(super) fn node_cost(blocks: usize, holders: usize) -> i64 {
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
pub(super) struct Counters {
    pub(super) nodes: AtomicI64,
    pub(super) blocks: AtomicI64,
    pub(super) bytes: AtomicI64,
    pub(super) evicted_nodes: AtomicU64,
    pub(super) evicted_bytes: AtomicU64,
    pub(super) expired_nodes: AtomicU64,
    pub(super) trims: AtomicU64,
    pub(super) trimmed_blocks: AtomicU64,
    pub(super) capacity_evicted_blocks: AtomicU64,
}

impl Counters {
    pub(super) fn add(&self, nodes: i64, blocks: i64, bytes: i64) {
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
pub(super) struct Totals {
    pub(super) nodes: i64,
    pub(super) blocks: i64,
    pub(super) bytes: i64,
}

impl Totals {
    pub(super) fn of(n: &Node) -> Totals {
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
    pub(super) fn add(&mut self, o: Totals) {
        self.nodes += o.nodes;
        self.blocks += o.blocks;
        self.bytes += o.bytes;
    }
}
