//! The gateway's clock: milliseconds on the process's monotonic clock (what the routing
//! plugins call `now_ms`; tests may move it forward, see [`adjustable`]), and the
//! stop-aware sleep of the background loops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How far tests moved the clock forward ([`advance`]).
static AHEAD_MS: AtomicU64 = AtomicU64::new(0);

/// Milliseconds since the process's first call (monotonic).
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + AHEAD_MS.load(Ordering::Relaxed)
}

/// The environment variable that lets tests move the clock ([`adjustable`]).
pub const TEST_CLOCK_ENV: &str = "TOKENGATE_TEST_CLOCK";

/// Whether the clock may be moved forward: only in a process started with
/// `TOKENGATE_TEST_CLOCK=1` (the integration tests, through `POST /admin/clock`), so that a
/// test that needs time to pass (the prefix index's 100 ms ticks) does not sleep.
pub fn adjustable() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(TEST_CLOCK_ENV).is_ok_and(|v| v == "1"))
}

/// Moves the clock forward by `ms` (see [`adjustable`]); returns the new time.
pub fn advance(ms: u64) -> u64 {
    AHEAD_MS.fetch_add(ms, Ordering::Relaxed);
    now_ms()
}

/// Sleeps for `d` unless shutdown starts first; returns whether to go on.
pub async fn sleep_or_stop(d: Duration, stop: &mut pingora::server::ShutdownWatch) -> bool {
    if *stop.borrow() {
        return false;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        r = stop.changed() => r.is_ok() && !*stop.borrow(),
    }
}
