//! A full recount of the index against its counters and invariants (tests, debugging).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

use super::node::{Node, Totals};
use super::PrefixIndex;
use crate::hash::InstanceKey;

impl PrefixIndex {
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
