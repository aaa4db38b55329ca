//! The load table: per-instance counters that every scheduling decision reads, and the RAII
//! guard that keeps them honest.
//!
//! A request acquires a [`LoadGuard`] when it is planned onto an instance (in-flight requests
//! +1, in-flight tokens +estimate, waiting +1), marks its first token (waiting −1: the end of
//! the prefill phase, which includes queueing in the engine — not the response header, which
//! engines send before prefill) and finishes with an outcome (completed or errors +1). Whatever path the request takes (success,
//! upstream error, the upstream dying mid-stream, the client hanging up, a retry to another
//! instance, a panic unwinding the task), the guard's `Drop` gives back exactly what it took,
//! once.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Live counters of one instance. All atomics: no lock on the hot path.
#[derive(Debug, Default)]
pub struct InstanceLoad {
    inflight_requests: AtomicU64,
    inflight_tokens: AtomicU64,
    waiting: AtomicU64,
    prefill_tokens: AtomicU64,
    completed: AtomicU64,
    errors: AtomicU64,
    cancelled: AtomicU64,
}

/// What the other replicas of a cluster have in flight on an instance (`cluster:`), as they
/// last published it: added to this replica's own counters when the scheduler compares
/// instances, so every replica balances on the fleet's load. Zero without a cluster.
#[derive(Debug, Default)]
pub struct RemoteLoad {
    pub inflight_requests: AtomicU64,
    pub inflight_tokens: AtomicU64,
    pub waiting: AtomicU64,
    pub prefill_tokens: AtomicU64,
}

impl RemoteLoad {
    /// `[requests, tokens, waiting, prefill tokens]`.
    pub fn set(&self, v: [u64; 4]) {
        self.inflight_requests.store(v[0], Relaxed);
        self.inflight_tokens.store(v[1], Relaxed);
        self.waiting.store(v[2], Relaxed);
        self.prefill_tokens.store(v[3], Relaxed);
    }

    pub fn get(&self) -> [u64; 4] {
        [
            self.inflight_requests.load(Relaxed),
            self.inflight_tokens.load(Relaxed),
            self.waiting.load(Relaxed),
            self.prefill_tokens.load(Relaxed),
        ]
    }
}

/// A copy of an instance's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadSnapshot {
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    /// In the prefill phase: dispatched, no first token yet.
    pub waiting: u64,
    /// Uncached prompt tokens of the waiting requests (estimated at dispatch): prefill work
    /// queued on the instance.
    pub prefill_tokens: u64,
    pub completed: u64,
    pub errors: u64,
    /// Requests whose client left before the response was complete.
    pub cancelled: u64,
}

impl InstanceLoad {
    pub fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            inflight_requests: self.inflight_requests.load(Relaxed),
            inflight_tokens: self.inflight_tokens.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            prefill_tokens: self.prefill_tokens.load(Relaxed),
            completed: self.completed.load(Relaxed),
            errors: self.errors.load(Relaxed),
            cancelled: self.cancelled.load(Relaxed),
        }
    }
}

/// Output tokens assumed for a request before its service's first answers (and the least a
/// `max_tokens` is capped to, see [`MeanOutput::expected`]).
pub const DEFAULT_EXPECTED_OUTPUT: u64 = 256;

/// A service's typical answer length: a moving average of the completion tokens its engines
/// reported (weight 1/64 per answer), starting at
/// [`DEFAULT_EXPECTED_OUTPUT`]. Lock-free (an `f64` in an atomic).
#[derive(Debug)]
pub struct MeanOutput(AtomicU64);

impl Default for MeanOutput {
    fn default() -> Self {
        MeanOutput(AtomicU64::new((DEFAULT_EXPECTED_OUTPUT as f64).to_bits()))
    }
}

impl MeanOutput {
    /// One answer of `tokens` completion tokens.
    pub fn observe(&self, tokens: u64) {
        let _ = self.0.fetch_update(Relaxed, Relaxed, |b| {
            let m = f64::from_bits(b);
            Some((m + (tokens as f64 - m) / 64.0).to_bits())
        });
    }

    /// The average answer, tokens (at least 1).
    pub fn get(&self) -> u64 {
        (f64::from_bits(self.0.load(Relaxed)).round() as u64).max(1)
    }

    /// The output tokens a request is expected to hold KV for and generate: its
    /// `max_tokens`, but no more than four average answers (at least
    /// [`DEFAULT_EXPECTED_OUTPUT`]) — clients often ask for far more than they get
    /// (coding agents send `max_tokens: 32000`) — and the average answer without one.
    pub fn expected(&self, max_tokens: Option<u64>) -> u64 {
        let mean = self.get();
        match max_tokens {
            Some(m) => m.min((4 * mean).max(DEFAULT_EXPECTED_OUTPUT)),
            None => mean,
        }
    }
}

/// Anything that owns an [`InstanceLoad`] (the gateway's instance type).
pub trait HasLoad: Send + Sync {
    fn load(&self) -> &InstanceLoad;
    /// A throttling slot of this instance was released (a prefill ended, a request
    /// finished): wake whoever waits for one.
    fn released(&self) {}
}

/// Slot limits (throttling): requests in their prefill phase and requests in flight at all;
/// 0 = no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub prefill: u64,
    pub total: u64,
}

impl Limits {
    pub fn none(self) -> bool {
        self.prefill == 0 && self.total == 0
    }
}

/// Slots counted over a whole service (throttling scope `service`).
#[derive(Debug, Default)]
pub struct SlotPool {
    pub prefill: AtomicU64,
    pub total: AtomicU64,
}

/// Adds 1 to `a` unless that would exceed `limit` (0 = no limit). Lock-free: concurrent
/// callers never push it past the limit together.
fn inc_within(a: &AtomicU64, limit: u64) -> bool {
    if limit == 0 {
        a.fetch_add(1, Relaxed);
        return true;
    }
    let mut cur = a.load(Relaxed);
    loop {
        if cur >= limit {
            return false;
        }
        match a.compare_exchange_weak(cur, cur + 1, Relaxed, Relaxed) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

pub use tokengate_plugins::Outcome;

/// The RAII handle of one dispatch. See the module docs.
#[derive(Debug)]
pub struct LoadGuard<I: HasLoad> {
    inst: Arc<I>,
    tokens: u64,
    prefill_tokens: u64,
    waiting: bool,
    outcome: Option<Outcome>,
    /// The service-wide slots this request also holds (throttling scope `service`).
    pool: Option<Arc<SlotPool>>,
}

impl<I: HasLoad> LoadGuard<I> {
    /// Counts a request of `tokens` expected tokens, `prefill_tokens` of which are uncached
    /// prompt tokens the instance will have to prefill, as dispatched to `inst`.
    pub fn acquire(inst: Arc<I>, tokens: u64, prefill_tokens: u64) -> Self {
        let l = inst.load();
        l.inflight_requests.fetch_add(1, Relaxed);
        l.inflight_tokens.fetch_add(tokens, Relaxed);
        l.waiting.fetch_add(1, Relaxed);
        l.prefill_tokens.fetch_add(prefill_tokens, Relaxed);
        LoadGuard {
            inst,
            tokens,
            prefill_tokens,
            waiting: true,
            outcome: None,
            pool: None,
        }
    }

    /// Like [`acquire`](Self::acquire), but only within the instance's `limits` and, when
    /// given, the service's `pool` limits: `None` (and nothing counted) when a slot is
    /// missing. Concurrent callers never overshoot a limit.
    pub fn try_acquire(
        inst: Arc<I>,
        tokens: u64,
        prefill_tokens: u64,
        limits: Limits,
        pool: Option<(&Arc<SlotPool>, Limits)>,
    ) -> Option<Self> {
        let l = inst.load();
        if !inc_within(&l.waiting, limits.prefill) {
            return None;
        }
        if !inc_within(&l.inflight_requests, limits.total) {
            l.waiting.fetch_sub(1, Relaxed);
            return None;
        }
        if let Some((p, pl)) = pool {
            if !inc_within(&p.prefill, pl.prefill) {
                l.waiting.fetch_sub(1, Relaxed);
                l.inflight_requests.fetch_sub(1, Relaxed);
                return None;
            }
            if !inc_within(&p.total, pl.total) {
                p.prefill.fetch_sub(1, Relaxed);
                l.waiting.fetch_sub(1, Relaxed);
                l.inflight_requests.fetch_sub(1, Relaxed);
                return None;
            }
        }
        l.inflight_tokens.fetch_add(tokens, Relaxed);
        l.prefill_tokens.fetch_add(prefill_tokens, Relaxed);
        Some(LoadGuard {
            inst,
            tokens,
            prefill_tokens,
            waiting: true,
            outcome: None,
            pool: pool.map(|(p, _)| p.clone()),
        })
    }

    pub fn instance(&self) -> &Arc<I> {
        &self.inst
    }

    /// The first token arrived: the prefill phase is over (no longer waiting). Idempotent.
    pub fn first_token(&mut self) {
        if std::mem::take(&mut self.waiting) {
            let l = self.inst.load();
            l.waiting.fetch_sub(1, Relaxed);
            l.prefill_tokens.fetch_sub(self.prefill_tokens, Relaxed);
            if let Some(p) = &self.pool {
                p.prefill.fetch_sub(1, Relaxed);
            }
            self.inst.released();
        }
    }

    /// Records how the request ended (the last call wins) and releases its load on drop.
    pub fn set_outcome(&mut self, o: Outcome) {
        self.outcome = Some(o);
    }

    /// Still in the prefill phase (no first token yet).
    pub fn is_waiting(&self) -> bool {
        self.waiting
    }

    /// Records the outcome and releases the counters now.
    pub fn finish(mut self, o: Outcome) {
        self.set_outcome(o);
    }
}

impl<I: HasLoad> Drop for LoadGuard<I> {
    fn drop(&mut self) {
        let l = self.inst.load();
        if self.waiting {
            l.waiting.fetch_sub(1, Relaxed);
            l.prefill_tokens.fetch_sub(self.prefill_tokens, Relaxed);
            if let Some(p) = &self.pool {
                p.prefill.fetch_sub(1, Relaxed);
            }
        }
        l.inflight_requests.fetch_sub(1, Relaxed);
        l.inflight_tokens.fetch_sub(self.tokens, Relaxed);
        if let Some(p) = &self.pool {
            p.total.fetch_sub(1, Relaxed);
        }
        match self.outcome {
            Some(Outcome::Completed) => l.completed.fetch_add(1, Relaxed),
            Some(Outcome::Cancelled) => l.cancelled.fetch_add(1, Relaxed),
            // A guard dropped without an outcome was abandoned (task cancelled): an error.
            Some(Outcome::Failed) | None => l.errors.fetch_add(1, Relaxed),
        };
        self.inst.released();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_max_tokens_counts_as_a_few_average_answers() {
        let m = MeanOutput::default();
        assert_eq!(m.get(), 256);
        // Before any answer: max_tokens up to 1,024 (4 × 256) as given, beyond that 1,024.
        assert_eq!(m.expected(Some(100)), 100);
        assert_eq!(m.expected(Some(32_000)), 1_024);
        assert_eq!(m.expected(None), 256);
        // Answers of ~2,000 tokens: the cap follows (4 × the average).
        for _ in 0..2_000 {
            m.observe(2_000);
        }
        assert_eq!(m.get(), 2_000);
        assert_eq!(m.expected(Some(32_000)), 8_000);
        assert_eq!(m.expected(Some(3_000)), 3_000);
        assert_eq!(m.expected(None), 2_000);
        // Short answers: the cap never goes below 256 (a max_tokens of 200 stays 200).
        for _ in 0..2_000 {
            m.observe(10);
        }
        assert_eq!(m.get(), 10);
        assert_eq!(m.expected(Some(200)), 200);
        assert_eq!(m.expected(Some(5_000)), 256);
    }

    #[derive(Default)]
    struct I(InstanceLoad);
    impl HasLoad for I {
        fn load(&self) -> &InstanceLoad {
            &self.0
        }
    }

    #[test]
    fn every_path_returns_to_zero_exactly_once() {
        let i = Arc::new(I::default());
        let mut a = LoadGuard::acquire(i.clone(), 100, 80);
        let b = LoadGuard::acquire(i.clone(), 50, 40);
        let c = LoadGuard::acquire(i.clone(), 7, 7);
        let d = LoadGuard::acquire(i.clone(), 1, 0);
        let s = i.0.snapshot();
        assert_eq!(
            (
                s.inflight_requests,
                s.inflight_tokens,
                s.waiting,
                s.prefill_tokens
            ),
            (4, 158, 4, 127)
        );
        a.first_token();
        a.first_token();
        assert_eq!(i.0.snapshot().waiting, 3);
        assert_eq!(i.0.snapshot().prefill_tokens, 47);
        a.finish(Outcome::Completed);
        b.finish(Outcome::Failed);
        drop(c); // abandoned
        d.finish(Outcome::Cancelled);
        let s = i.0.snapshot();
        assert_eq!(
            s,
            LoadSnapshot {
                inflight_requests: 0,
                inflight_tokens: 0,
                waiting: 0,
                prefill_tokens: 0,
                completed: 1,
                errors: 2,
                cancelled: 1,
            }
        );
    }

    #[test]
    fn slots_are_never_overshot_and_always_returned() {
        let i = Arc::new(I::default());
        let pool = Arc::new(SlotPool::default());
        let lim = Limits {
            prefill: 2,
            total: 3,
        };
        let mut a = LoadGuard::try_acquire(i.clone(), 10, 5, lim, None).unwrap();
        let b = LoadGuard::try_acquire(i.clone(), 10, 5, lim, None).unwrap();
        // Two in prefill: a third waits.
        assert!(LoadGuard::try_acquire(i.clone(), 10, 5, lim, None).is_none());
        a.first_token();
        let c = LoadGuard::try_acquire(i.clone(), 10, 5, lim, None).unwrap();
        // Three in flight: the total limit holds even with a free prefill slot.
        let mut c = c;
        c.first_token();
        assert!(LoadGuard::try_acquire(i.clone(), 10, 5, lim, None).is_none());
        drop((a, b, c));
        assert_eq!(i.0.snapshot().inflight_requests, 0);
        // A service pool of 1 prefill slot over two instances.
        let j = Arc::new(I::default());
        let pl = Limits {
            prefill: 1,
            total: 0,
        };
        let x =
            LoadGuard::try_acquire(i.clone(), 1, 1, Limits::default(), Some((&pool, pl))).unwrap();
        assert!(
            LoadGuard::try_acquire(j.clone(), 1, 1, Limits::default(), Some((&pool, pl))).is_none()
        );
        assert_eq!(j.0.snapshot().inflight_requests, 0, "rolled back");
        drop(x);
        assert_eq!(pool.prefill.load(Relaxed), 0);
        assert_eq!(pool.total.load(Relaxed), 0);
        // Many threads racing for 4 prefill slots: never more than 4 at once.
        let k = Arc::new(I::default());
        let peak = Arc::new(AtomicU64::new(0));
        let lim4 = Limits {
            prefill: 4,
            total: 0,
        };
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (k, peak) = (k.clone(), peak.clone());
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        if let Some(g) = LoadGuard::try_acquire(k.clone(), 1, 1, lim4, None) {
                            peak.fetch_max(k.0.snapshot().waiting, Relaxed);
                            drop(g);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Relaxed) <= 4);
        assert_eq!(k.0.snapshot().waiting, 0);
    }
}
