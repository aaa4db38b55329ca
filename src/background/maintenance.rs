//! Background upkeep of the routing state, every `prefix_index.maintenance_interval` (a
//! reload restarts the wait with the new interval): expired session bindings and prefix-index
//! entries are swept, and when the process uses more memory than allowed ([`crate::memory`])
//! the prefix indexes give back their least recently used entries.

use crate::clock::{now_ms, sleep_or_stop};
use crate::memory::{container_memory, process_rss};
use crate::shared::Shared;
use log::{info, warn};
use std::sync::Arc;

/// One maintenance pass. Returns the bytes evicted for memory.
pub fn run_once(shared: &Shared) -> u64 {
    let rt = shared.runtime.load();
    let now = now_ms();
    for (_, s) in rt.schedulers() {
        s.sweep(now);
    }
    for s in &rt.ordered {
        s.index.sweep_expired(now);
    }
    let policy = rt.memory;
    let (Some(container), Some(rss)) = (
        policy.limit_override.or_else(container_memory),
        process_rss(),
    ) else {
        return 0;
    };
    let budget = policy.budget(container);
    if rss <= budget {
        return 0;
    }
    // Free the excess from the indexes, in proportion to their size.
    let excess = rss - budget;
    let total: u64 = rt.ordered.iter().map(|s| s.index.approx_bytes()).sum();
    if total == 0 {
        return 0;
    }
    let mut freed = 0;
    for s in &rt.ordered {
        let b = s.index.approx_bytes();
        if b == 0 {
            continue;
        }
        let share = ((excess as u128 * b as u128) / total as u128) as u64;
        let f = s.index.evict_lru(share.clamp(1, b));
        if f > 0 {
            info!(
                "prefix index of {}: evicted {f} bytes (process {rss} B > budget {budget} B)",
                s.name
            );
        }
        freed += f;
    }
    freed
}

/// Runs [`run_once`] every `prefix_index.maintenance_interval` until `stop` fires. A reload
/// restarts the wait with the new interval.
pub async fn run(shared: Arc<Shared>, mut stop: pingora::server::ShutdownWatch) {
    let mut reloads = shared.generation.subscribe();
    loop {
        let interval = shared.runtime.load().maintenance_interval;
        let go_on = tokio::select! {
            r = sleep_or_stop(interval, &mut stop) => r,
            r = reloads.changed() => {
                if r.is_ok() {
                    continue; // the new config's interval, from now
                }
                sleep_or_stop(interval, &mut stop).await
            }
        };
        if !go_on {
            return;
        }
        let s = shared.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || run_once(&s)).await {
            warn!("maintenance pass failed: {e}");
        }
    }
}
