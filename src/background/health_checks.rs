//! The active health checks: every `health_check.interval` each instance gets `GET path`
//! (see [`crate::health`] for what the results do). The current config is read every round,
//! so a reload applies.

use crate::clock::sleep_or_stop;
use crate::shared::Shared;
use std::sync::Arc;

/// Runs the active checks until `stop` fires (reads the current config every round, so
/// reloads apply).
pub async fn run_checks(shared: Arc<Shared>, mut stop: pingora::server::ShutdownWatch) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap_or_default();
    loop {
        let rt = shared.runtime.load_full();
        let hc = rt.health_check.clone();
        if hc.enabled {
            let checks = rt.ordered.iter().flat_map(|s| s.instances.iter()).map(|i| {
                let url = format!("http://{}{}", i.addr, hc.path);
                let client = client.clone();
                let i = i.clone();
                let hc = hc.clone();
                async move {
                    let ok = matches!(
                        tokio::time::timeout(hc.timeout, client.get(&url).send()).await,
                        Ok(Ok(r)) if r.status().is_success()
                    );
                    match i.health.on_check(ok, hc.rise, hc.fall) {
                        Some(true) => log::warn!("instance {} is healthy again ({url})", i.id),
                        Some(false) => log::warn!(
                            "instance {} is unhealthy: {} failed checks of {url}; it gets no requests",
                            i.id, hc.fall
                        ),
                        None => {}
                    }
                }
            });
            futures_util::future::join_all(checks).await;
        }
        if !sleep_or_stop(hc.interval, &mut stop).await {
            return;
        }
    }
}
