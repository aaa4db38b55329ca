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

/// Anything that owns an [`InstanceLoad`] (the gateway's instance type).
pub trait HasLoad: Send + Sync {
    fn load(&self) -> &InstanceLoad;
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
        }
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
        }
        l.inflight_requests.fetch_sub(1, Relaxed);
        l.inflight_tokens.fetch_sub(self.tokens, Relaxed);
        match self.outcome {
            Some(Outcome::Completed) => l.completed.fetch_add(1, Relaxed),
            Some(Outcome::Cancelled) => l.cancelled.fetch_add(1, Relaxed),
            // A guard dropped without an outcome was abandoned (task cancelled): an error.
            Some(Outcome::Failed) | None => l.errors.fetch_add(1, Relaxed),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
