//! The gateway's clock: milliseconds on the process's monotonic clock (what the routing
//! plugins call `now_ms`), and the stop-aware sleep of the background loops.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Milliseconds since the process's first call (monotonic).
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
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
