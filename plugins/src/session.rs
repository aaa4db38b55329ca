//! The session table: session key → the instance the session is bound to.
//!
//! Keeping a conversation on one instance keeps its KV cache warm. The table is the state
//! behind layered mode's affinity layer and policy mode's affinity scorer.
//!
//! * Sharded by the session key's hash into `shards` `parking_lot::Mutex`es; every operation
//!   locks exactly one shard (no global lock on the hot path).
//! * `ttl` (default 1800 s): a binding unused for this long is gone (ignored at once, freed
//!   lazily or by [`SessionTable::sweep_expired`]). Using a binding refreshes it.
//! * `max_entries` (default 100 000): each shard holds at most `max_entries / shards`
//!   (rounded up); inserting into a full shard evicts that shard's least recently used
//!   binding. Recency is kept by a per-shard queue of (key, last use) with lazy deletion:
//!   a refresh pushes a new pair and the old one is skipped when it reaches the front; the
//!   queue is rebuilt when it grows past twice the map, so every operation is amortised O(1).
//! * Time is the caller's `now_ms` (any monotonic millisecond clock).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::hash::{shard_count, shard_of, InstanceKey, PreHashed, SessionKey};

/// Configuration of a session table.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionConfig {
    /// A binding unused for this long expires. Default 1 800 000 ms (30 min).
    pub ttl_ms: u64,
    /// Upper bound on bindings (approximately: per shard, rounded up). Default 100 000.
    pub max_entries: usize,
    /// Lock stripes (rounded up to a power of two, at most `max_entries / 16`). Default 64.
    pub shards: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            ttl_ms: 1_800_000,
            max_entries: 100_000,
            shards: 64,
        }
    }
}

/// Gauges and counters of a session table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionGauges {
    pub entries: u64,
    /// Bindings evicted because the table was full.
    pub evictions: u64,
    /// Bindings dropped because they expired.
    pub expired: u64,
}

#[derive(Clone, Copy, Debug)]
struct Binding {
    instance: InstanceKey,
    last_used: u64,
}

#[derive(Default)]
struct Shard {
    map: HashMap<u64, Binding, PreHashed>,
    /// (key, last use) in use order; stale pairs are skipped.
    order: VecDeque<(u64, u64)>,
}

/// See the module documentation.
pub struct SessionTable {
    shards: Box<[Mutex<Shard>]>,
    ttl_ms: AtomicU64,
    /// The configured `max_entries` (the bound is enforced per shard: `cap` each).
    max_entries: usize,
    cap: usize,
    entries: AtomicI64,
    evictions: AtomicU64,
    expired: AtomicU64,
}

impl Default for SessionTable {
    fn default() -> Self {
        SessionTable::new(SessionConfig::default())
    }
}

impl std::fmt::Debug for SessionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTable")
            .field("ttl_ms", &self.ttl_ms.load(Relaxed))
            .field("gauges", &self.gauges())
            .finish()
    }
}

impl SessionTable {
    pub fn new(cfg: SessionConfig) -> Self {
        let max = cfg.max_entries.max(1);
        let mut n = shard_count(cfg.shards);
        // At least 16 entries per shard: the LRU bound is per shard, so a small table needs few
        // shards to evict the truly least recently used.
        while n > 1 && n * 16 > max {
            n /= 2;
        }
        SessionTable {
            shards: (0..n).map(|_| Mutex::new(Shard::default())).collect(),
            ttl_ms: AtomicU64::new(cfg.ttl_ms),
            max_entries: max,
            cap: max.div_ceil(n),
            entries: AtomicI64::new(0),
            evictions: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }

    /// A table of `cfg` holding the most recently used live bindings of `from` (at most
    /// `cfg.max_entries`): how a config reload that changes the table's size applies.
    pub fn migrated(cfg: SessionConfig, from: &SessionTable, now_ms: u64) -> Self {
        let t = SessionTable::new(cfg);
        let mut live: Vec<(u64, Binding)> = Vec::with_capacity(from.len());
        for shard in from.shards.iter() {
            let sh = shard.lock();
            live.extend(
                sh.map
                    .iter()
                    .filter(|(_, b)| !from.is_expired(b, now_ms))
                    .map(|(k, b)| (*k, *b)),
            );
        }
        live.sort_unstable_by_key(|(_, b)| std::cmp::Reverse(b.last_used));
        live.truncate(t.max_entries);
        for (k, b) in live.into_iter().rev() {
            t.bind(SessionKey(k), b.instance, b.last_used);
        }
        t
    }

    /// The settings this table applies (`shards` as built).
    pub fn config(&self) -> SessionConfig {
        SessionConfig {
            ttl_ms: self.ttl_ms.load(Relaxed),
            max_entries: self.max_entries,
            shards: self.shards.len(),
        }
    }

    /// Changes the binding lifetime in place (a config reload).
    pub fn set_ttl_ms(&self, ttl_ms: u64) {
        self.ttl_ms.store(ttl_ms, Relaxed);
    }

    fn shard(&self, s: SessionKey) -> &Mutex<Shard> {
        &self.shards[shard_of(s.0, self.shards.len())]
    }

    fn is_expired(&self, b: &Binding, now_ms: u64) -> bool {
        b.last_used.saturating_add(self.ttl_ms.load(Relaxed)) < now_ms
    }

    /// The live binding of `s`, without refreshing it.
    pub fn get(&self, s: SessionKey, now_ms: u64) -> Option<InstanceKey> {
        let mut sh = self.shard(s).lock();
        let b = *sh.map.get(&s.0)?;
        if self.is_expired(&b, now_ms) {
            sh.map.remove(&s.0);
            self.entries.fetch_sub(1, Relaxed);
            self.expired.fetch_add(1, Relaxed);
            return None;
        }
        Some(b.instance)
    }

    /// Binds `s` to `instance` (or refreshes the binding) at `now_ms`. Returns the previous
    /// live binding, if any. May evict the shard's least recently used binding.
    pub fn bind(&self, s: SessionKey, instance: InstanceKey, now_ms: u64) -> Option<InstanceKey> {
        let mut sh = self.shard(s).lock();
        self.purge_front(&mut sh, now_ms);
        let prev = match sh.map.get_mut(&s.0) {
            Some(b) => {
                let prev = (!self.is_expired(b, now_ms)).then_some(b.instance);
                let refreshed = b.last_used != now_ms;
                *b = Binding {
                    instance,
                    last_used: now_ms,
                };
                if refreshed {
                    sh.order.push_back((s.0, now_ms));
                }
                prev
            }
            None => {
                if sh.map.len() >= self.cap {
                    self.evict_one(&mut sh);
                }
                sh.map.insert(
                    s.0,
                    Binding {
                        instance,
                        last_used: now_ms,
                    },
                );
                sh.order.push_back((s.0, now_ms));
                self.entries.fetch_add(1, Relaxed);
                None
            }
        };
        self.maybe_compact(&mut sh);
        prev
    }

    /// Refreshes a live binding. Returns whether there was one.
    pub fn touch(&self, s: SessionKey, now_ms: u64) -> bool {
        let mut sh = self.shard(s).lock();
        let Some(b) = sh.map.get_mut(&s.0) else {
            return false;
        };
        if self.is_expired(b, now_ms) {
            return false;
        }
        if b.last_used != now_ms {
            b.last_used = b.last_used.max(now_ms);
            let ts = b.last_used;
            sh.order.push_back((s.0, ts));
            self.maybe_compact(&mut sh);
        }
        true
    }

    /// Forgets a session.
    pub fn remove(&self, s: SessionKey) -> Option<InstanceKey> {
        let b = self.shard(s).lock().map.remove(&s.0)?;
        self.entries.fetch_sub(1, Relaxed);
        Some(b.instance)
    }

    /// Forgets every session bound to `instance` (it left the service). Returns how many.
    pub fn remove_instance(&self, instance: InstanceKey) -> usize {
        self.retain_all(|b| b.instance != instance)
    }

    /// Frees expired bindings. Returns how many.
    pub fn sweep_expired(&self, now_ms: u64) -> usize {
        let n = self.retain_all(|b| !self.is_expired(b, now_ms));
        self.expired.fetch_add(n as u64, Relaxed);
        n
    }

    fn retain_all(&self, keep: impl Fn(&Binding) -> bool) -> usize {
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut sh = shard.lock();
            let before = sh.map.len();
            sh.map.retain(|_, b| keep(b));
            removed += before - sh.map.len();
            self.maybe_compact(&mut sh);
        }
        self.entries.fetch_sub(removed as i64, Relaxed);
        removed
    }

    pub fn len(&self) -> usize {
        self.entries.load(Relaxed).max(0) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn gauges(&self) -> SessionGauges {
        SessionGauges {
            entries: self.len() as u64,
            evictions: self.evictions.load(Relaxed),
            expired: self.expired.load(Relaxed),
        }
    }

    /// Drops stale queue pairs and expired bindings at the front of the queue (bounded work).
    fn purge_front(&self, sh: &mut Shard, now_ms: u64) {
        for _ in 0..4 {
            let Some(&(k, ts)) = sh.order.front() else {
                return;
            };
            match sh.map.get(&k) {
                Some(b) if b.last_used == ts => {
                    if !self.is_expired(b, now_ms) {
                        return;
                    }
                    sh.map.remove(&k);
                    self.entries.fetch_sub(1, Relaxed);
                    self.expired.fetch_add(1, Relaxed);
                }
                _ => {}
            }
            sh.order.pop_front();
        }
    }

    /// Removes the least recently used live binding of the shard.
    fn evict_one(&self, sh: &mut Shard) {
        while let Some((k, ts)) = sh.order.pop_front() {
            if sh.map.get(&k).is_some_and(|b| b.last_used == ts) {
                sh.map.remove(&k);
                self.entries.fetch_sub(1, Relaxed);
                self.evictions.fetch_add(1, Relaxed);
                return;
            }
        }
        // The queue lost track (cannot happen, but stay bounded): evict the oldest by scan.
        if let Some((&k, _)) = sh.map.iter().min_by_key(|(_, b)| b.last_used) {
            sh.map.remove(&k);
            self.entries.fetch_sub(1, Relaxed);
            self.evictions.fetch_add(1, Relaxed);
        }
    }

    fn maybe_compact(&self, sh: &mut Shard) {
        if sh.order.len() > 2 * sh.map.len() + 64 {
            let mut v: Vec<(u64, u64)> = sh.map.iter().map(|(k, b)| (*k, b.last_used)).collect();
            v.sort_unstable_by_key(|&(_, ts)| ts);
            sh.order = v.into();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(ttl_ms: u64, max_entries: usize) -> SessionTable {
        SessionTable::new(SessionConfig {
            ttl_ms,
            max_entries,
            shards: 1,
        })
    }
    fn s(i: u64) -> SessionKey {
        SessionKey(i)
    }
    fn inst(i: u64) -> InstanceKey {
        InstanceKey(i)
    }

    #[test]
    fn bind_get_rebind() {
        let t = table(1000, 10);
        assert_eq!(t.get(s(1), 0), None);
        assert_eq!(t.bind(s(1), inst(7), 0), None);
        assert_eq!(t.get(s(1), 10), Some(inst(7)));
        assert_eq!(t.bind(s(1), inst(8), 20), Some(inst(7)));
        assert_eq!(t.get(s(1), 30), Some(inst(8)));
        assert_eq!(t.len(), 1);
        assert_eq!(t.remove(s(1)), Some(inst(8)));
        assert!(t.is_empty());
    }

    #[test]
    fn ttl_is_refreshed_on_use() {
        let t = table(1000, 10);
        t.bind(s(1), inst(1), 0);
        assert!(t.touch(s(1), 900));
        assert_eq!(t.get(s(1), 1800), Some(inst(1))); // 900 + 1000 > 1800
        assert_eq!(t.get(s(1), 1901), None);
        assert!(!t.touch(s(1), 1902));
        assert_eq!(t.gauges().expired, 1);
        // A rebind of an expired session reports no previous binding.
        t.bind(s(2), inst(1), 0);
        assert_eq!(t.bind(s(2), inst(2), 5000), None);
    }

    #[test]
    fn the_least_recently_used_binding_is_evicted_when_full() {
        let t = table(1_000_000, 3);
        t.bind(s(1), inst(1), 1);
        t.bind(s(2), inst(1), 2);
        t.bind(s(3), inst(1), 3);
        t.touch(s(1), 4); // s2 is now the oldest
        t.bind(s(4), inst(1), 5);
        assert_eq!(t.len(), 3);
        assert_eq!(t.get(s(2), 6), None);
        for k in [1, 3, 4] {
            assert_eq!(t.get(s(k), 6), Some(inst(1)), "session {k}");
        }
        assert_eq!(t.gauges().evictions, 1);
    }

    #[test]
    fn many_refreshes_keep_the_queue_bounded_and_lru_exact() {
        let t = table(u64::MAX / 2, 50);
        for now in 0..100_000u64 {
            t.bind(s(now % 50), inst(now % 7), now);
        }
        let q = t.shards[0].lock().order.len();
        assert!(q <= 2 * 50 + 65, "queue {q}");
        // Session 0 was used longest ago; a new session evicts exactly it.
        t.bind(s(1000), inst(1), 200_000);
        assert_eq!(t.get(s(0), 200_001), None);
        assert_eq!(t.get(s(1), 200_001), Some(inst(99_951 % 7))); // last bound at 99 951
        assert_eq!(t.len(), 50);
    }

    #[test]
    fn sweep_and_remove_instance() {
        let t = SessionTable::new(SessionConfig {
            ttl_ms: 1000,
            ..SessionConfig::default()
        });
        for i in 0..1000 {
            t.bind(s(i * 0x1_0000_0001), inst(i % 4), i);
        }
        assert_eq!(t.len(), 1000);
        assert_eq!(t.remove_instance(inst(0)), 250);
        assert_eq!(t.sweep_expired(1500), 375); // last use < 500 and not instance 0
        assert_eq!(t.len(), 375);
        assert_eq!(t.gauges().expired, 375);
    }

    #[test]
    fn max_entries_holds_across_shards() {
        let t = SessionTable::new(SessionConfig {
            max_entries: 1000,
            ..SessionConfig::default()
        });
        for i in 0..10_000u64 {
            t.bind(SessionKey::of(&i.to_string()), inst(1), i);
        }
        // Per-shard caps round up: at most one extra entry per shard.
        assert!(t.len() <= 1000 + 64, "{}", t.len());
        assert!(t.len() >= 900, "{}", t.len());
        assert_eq!(t.gauges().evictions as usize + t.len(), 10_000);
    }

    #[test]
    fn migrating_keeps_the_most_recent_bindings_within_the_new_bound() {
        let t = table(1000, 100);
        for i in 0..10u64 {
            t.bind(SessionKey(i), InstanceKey(i % 3), i * 10);
        }
        // Session 0 expired by now (used at 0, ttl 1000, now 1005).
        let small = SessionTable::migrated(
            SessionConfig {
                ttl_ms: 5000,
                max_entries: 4,
                ..SessionConfig::default()
            },
            &t,
            1005,
        );
        assert_eq!(small.len(), 4);
        for i in 6..10u64 {
            assert_eq!(small.get(SessionKey(i), 1005), Some(InstanceKey(i % 3)));
        }
        assert_eq!(small.get(SessionKey(5), 1005), None);
        assert_eq!(small.config().max_entries, 4);
        // A TTL change applies in place.
        small.set_ttl_ms(10);
        assert_eq!(small.get(SessionKey(9), 1005), None);
    }
}
