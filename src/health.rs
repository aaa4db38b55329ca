//! Instance health: active HTTP checks and passive ejection.
//!
//! * **Active**: every `health_check.interval` (2 s) each instance gets `GET path`; `fall`
//!   consecutive failures (timeout or non-2xx) mark it unhealthy, and so does a single
//!   check whose connection fails (refused: nothing listens, the engine is gone), so a
//!   killed engine leaves within one interval; `rise` consecutive successes make it healthy
//!   again.
//! * **Passive**: `passive.max_failures` consecutive failed requests (connect error, timeout,
//!   5xx, dying mid-response) eject the instance for `passive.eject_for`; when that backoff
//!   ends it is re-admitted only after a health check succeeds (with active checks off, at
//!   once), so a dead engine is not handed requests again just because time passed. An
//!   instance whose active checks failed and pass again (`rise` in a row: an engine
//!   restarted) is back at once, its ejection over.
//!
//! An instance that is unhealthy or ejected leaves the candidate set at once (the pipelines'
//! `Available` filter); when no instance of a destination is available the request gets a
//! 503. This module holds the state; the checks run in [`crate::background::health_checks`].

use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// Health state of one instance (shared across config reloads like its load).
#[derive(Debug)]
pub struct Health {
    /// Result of the active checks (true until they say otherwise).
    healthy: AtomicBool,
    check_failures: AtomicU32,
    check_successes: AtomicU32,
    /// Consecutive failed requests (passive).
    request_failures: AtomicU32,
    /// Ejected until this `now_ms`.
    ejected_until: AtomicU64,
    ejections: AtomicU64,
    /// The instance's host name resolves (false: it stopped resolving; unavailable until
    /// it does again).
    resolved: AtomicBool,
    /// Ejected, and not back until a health check passes after the ejection ends.
    awaiting_probe: AtomicBool,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            healthy: AtomicBool::new(true),
            check_failures: AtomicU32::new(0),
            check_successes: AtomicU32::new(0),
            request_failures: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            ejections: AtomicU64::new(0),
            resolved: AtomicBool::new(true),
            awaiting_probe: AtomicBool::new(false),
        }
    }
}

/// What `/admin/instances` shows.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct HealthView {
    pub healthy: bool,
    pub ejected: bool,
    pub ejected_for_ms: u64,
    pub ejections: u64,
    pub consecutive_failures: u32,
    /// Its host name resolves (always true for an IP address).
    pub resolved: bool,
    /// Ejected: back only once a health check passes after the ejection.
    pub awaiting_probe: bool,
}

impl Health {
    /// Whether the instance may receive requests at `now_ms`.
    pub fn available(&self, now_ms: u64) -> bool {
        self.healthy.load(Relaxed)
            && now_ms >= self.ejected_until.load(Relaxed)
            && self.resolved.load(Relaxed)
            && !self.awaiting_probe.load(Relaxed)
    }

    /// A health check passed at `now_ms`: an ejection that has run its time ends.
    /// Returns whether that re-admitted the instance.
    pub fn probe_passed(&self, now_ms: u64) -> bool {
        now_ms >= self.ejected_until.load(Relaxed) && self.awaiting_probe.swap(false, Relaxed)
    }

    /// Active checks are off: ejections end with their time alone.
    pub fn no_probes(&self) {
        self.awaiting_probe.store(false, Relaxed);
    }

    /// Whether the instance's host name resolves; returns whether that changed.
    pub fn set_resolved(&self, ok: bool) -> bool {
        self.resolved.swap(ok, Relaxed) != ok
    }

    pub fn view(&self, now_ms: u64) -> HealthView {
        let until = self.ejected_until.load(Relaxed);
        HealthView {
            healthy: self.healthy.load(Relaxed),
            ejected: now_ms < until,
            ejected_for_ms: until.saturating_sub(now_ms),
            ejections: self.ejections.load(Relaxed),
            consecutive_failures: self.request_failures.load(Relaxed),
            resolved: self.resolved.load(Relaxed),
            awaiting_probe: self.awaiting_probe.load(Relaxed),
        }
    }

    /// An active check's result (`refused`: its connection failed). Returns the new state
    /// when it changed.
    pub fn on_check(&self, ok: bool, refused: bool, rise: u32, fall: u32) -> Option<bool> {
        if ok {
            self.check_failures.store(0, Relaxed);
            let n = self.check_successes.fetch_add(1, Relaxed) + 1;
            if n >= rise && !self.healthy.swap(true, Relaxed) {
                // Back from failed checks (an engine restarted): the request failures it had
                // while its checks failed ended with them, and so does their ejection — a
                // restarted engine is not left idle for the rest of `eject_for` while its
                // peers queue.
                self.ejected_until.store(0, Relaxed);
                self.awaiting_probe.store(false, Relaxed);
                self.request_failures.store(0, Relaxed);
                return Some(true);
            }
        } else {
            self.check_successes.store(0, Relaxed);
            let n = self.check_failures.fetch_add(1, Relaxed) + 1;
            if (n >= fall || refused) && self.healthy.swap(false, Relaxed) {
                return Some(false);
            }
        }
        None
    }

    /// A request's outcome (passive). Returns true when this failure ejected the instance.
    pub fn on_request(&self, failed: bool, max_failures: u32, eject_ms: u64, now_ms: u64) -> bool {
        if !failed {
            self.request_failures.store(0, Relaxed);
            return false;
        }
        let n = self.request_failures.fetch_add(1, Relaxed) + 1;
        if max_failures > 0 && n >= max_failures {
            self.request_failures.store(0, Relaxed);
            self.ejected_until.store(now_ms + eject_ms, Relaxed);
            self.awaiting_probe.store(true, Relaxed);
            self.ejections.fetch_add(1, Relaxed);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_checks_need_rise_and_fall_in_a_row() {
        let h = Health::default();
        assert!(h.available(0));
        assert_eq!(h.on_check(false, false, 2, 3), None);
        assert_eq!(h.on_check(false, false, 2, 3), None);
        assert_eq!(h.on_check(true, false, 2, 3), None); // streak broken
        assert_eq!(h.on_check(false, false, 2, 3), None);
        assert_eq!(h.on_check(false, false, 2, 3), None);
        assert_eq!(h.on_check(false, false, 2, 3), Some(false));
        assert!(!h.available(0));
        assert_eq!(h.on_check(true, false, 2, 3), None);
        assert_eq!(h.on_check(true, false, 2, 3), Some(true));
        assert!(h.available(0));
        // A refused connection: nothing listens; out at the first check.
        assert_eq!(h.on_check(false, true, 2, 3), Some(false));
        assert!(!h.available(0));
    }

    #[test]
    fn passive_ejection_and_readmission() {
        let h = Health::default();
        assert!(!h.on_request(true, 3, 1000, 10));
        assert!(!h.on_request(false, 3, 1000, 10)); // a success resets the streak
        assert!(!h.on_request(true, 3, 1000, 10));
        assert!(!h.on_request(true, 3, 1000, 10));
        assert!(h.on_request(true, 3, 1000, 10));
        assert!(!h.available(500));
        assert!(h.view(500).ejected);
        // A check that passes during the ejection does not end it early.
        assert!(!h.probe_passed(500));
        // Its time is over, but no check has passed since: still out.
        assert!(!h.available(1010));
        assert!(h.view(1010).awaiting_probe);
        assert!(h.probe_passed(1020));
        assert!(h.available(1020));
        assert_eq!(h.view(1020).ejections, 1);
        // Without active checks, the time alone ends an ejection.
        assert!(h.on_request(true, 1, 1000, 2000));
        h.no_probes();
        assert!(h.available(3000));
    }

    #[test]
    fn an_engine_back_from_failed_checks_is_not_left_ejected() {
        let h = Health::default();
        // Killed: its requests fail (ejected for 10 s) and its check is refused.
        assert!(h.on_request(true, 1, 10_000, 0));
        assert_eq!(h.on_check(false, true, 2, 3), Some(false));
        // Restarted: two checks pass; it is back at once, not at the end of the ejection.
        assert_eq!(h.on_check(true, false, 2, 3), None);
        assert!(!h.available(3_000));
        assert_eq!(h.on_check(true, false, 2, 3), Some(true));
        assert!(h.available(4_000));
        assert!(!h.view(4_000).ejected);
        // An ejection while its checks pass (it fails requests, not checks) still runs its
        // time.
        assert!(h.on_request(true, 1, 10_000, 5_000));
        assert_eq!(h.on_check(true, false, 2, 3), None);
        assert!(!h.available(6_000));
    }
}
