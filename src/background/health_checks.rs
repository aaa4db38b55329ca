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
            let checks = rt.ordered.iter().flat_map(|s| s.instances.iter().map(move |i| (s, i))).map(|(s, i)| {
                let url = i.url(&hc.path);
                let req = i.request(&s.http, reqwest::Method::GET, &hc.path);
                let i = i.clone();
                let hc = hc.clone();
                async move {
                    let r = tokio::time::timeout(hc.timeout, req.send()).await;
                    let ok = matches!(&r, Ok(Ok(r)) if r.status().is_success());
                    // Nothing listens (refused, reset while connecting): the engine is gone.
                    let refused = matches!(&r, Ok(Err(e)) if e.is_connect());
                    match i.health.on_check(ok, refused, hc.rise, hc.fall) {
                        Some(true) => log::warn!("instance {} is healthy again ({url})", i.id),
                        Some(false) if refused => log::warn!(
                            "instance {} is unhealthy: its check of {url} could not connect; it gets no requests",
                            i.id
                        ),
                        Some(false) => log::warn!(
                            "instance {} is unhealthy: {} failed checks of {url}; it gets no requests",
                            i.id, hc.fall
                        ),
                        None => {}
                    }
                    if ok && i.health.probe_passed(crate::clock::now_ms()) {
                        log::info!("instance {}: its ejection is over and {url} answers; it gets requests again", i.id);
                    }
                }
            });
            futures_util::future::join_all(checks).await;
            // Member gateways of other regions: names resolved again, `GET /health`.
            let members = rt.members.iter().map(|m| {
                let e = m.endpoint.clone();
                let client = client.clone();
                let hc = hc.clone();
                async move {
                    let e2 = e.clone();
                    let resolved =
                        tokio::task::spawn_blocking(move || e2.resolve().map(|n| n > 0))
                            .await
                            .ok()
                            .and_then(Result::ok)
                            .unwrap_or(false);
                    let url = format!("{}{}{}", e.origin(), e.base_path, hc.path);
                    let ok = resolved
                        && matches!(
                            tokio::time::timeout(hc.timeout, client.get(&url).send()).await,
                            Ok(Ok(r)) if r.status().is_success()
                        );
                    match e.health.on_check(ok, false, hc.rise, hc.fall) {
                        Some(true) => log::warn!("gateway {} is up again ({url})", e.name),
                        Some(false) => log::warn!(
                            "gateway {} is down: {} failed checks of {url}; no requests are forwarded to it",
                            e.name, hc.fall
                        ),
                        None => {}
                    }
                }
            });
            futures_util::future::join_all(members).await;
        } else {
            // No checks to end ejections: their time alone does.
            for i in rt.ordered.iter().flat_map(|s| s.instances.iter()) {
                i.health.no_probes();
            }
        }
        // Split-proxy entries: names resolved again (external APIs get no health requests;
        // their failures fail over per request). A name that stops resolving keeps its last
        // addresses.
        if let Some(sp) = rt.split.clone() {
            let _ = tokio::task::spawn_blocking(move || {
                for e in sp.entries.iter().filter_map(|e| e.endpoint.as_ref()) {
                    if let Err(err) = e.resolve() {
                        log::debug!("split.proxies entry {}: {err}", e.name);
                    }
                }
            })
            .await;
        }
        if !sleep_or_stop(hc.interval, &mut stop).await {
            return;
        }
    }
}
