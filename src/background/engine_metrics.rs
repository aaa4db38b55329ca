//! Scrapes the engines' own load figures ([`crate::engine_metrics`]) for the services that
//! ask (`engine_metrics: {interval, timeout, path}`), until shutdown. The config is read
//! again every round, so a reload applies.

use crate::clock::{now_ms, sleep_or_stop};
use crate::engine_metrics::{block_tokens, cache_tokens, parse};
use crate::shared::Shared;
use log::debug;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The shortest wait between two rounds.
const TICK: Duration = Duration::from_millis(100);

pub async fn run(shared: Arc<Shared>, mut stop: pingora::server::ShutdownWatch) {
    let mut last: HashMap<String, Instant> = HashMap::new();
    loop {
        let rt = shared.runtime.load_full();
        let mut next = Duration::from_secs(1);
        let mut scrapes = Vec::new();
        for (svc, em) in &rt.engine_metrics {
            next = next.min(em.interval);
            let due = last
                .get(&svc.name)
                .is_none_or(|t| t.elapsed() >= em.interval);
            if !due {
                continue;
            }
            last.insert(svc.name.clone(), Instant::now());
            for i in &svc.instances {
                let url = i.url(&em.path);
                let req = i.request(&svc.http, reqwest::Method::GET, &em.path);
                let i = i.clone();
                let timeout = em.timeout;
                scrapes.push(async move {
                    let got = tokio::time::timeout(timeout, async {
                        let r = req.send().await.ok()?;
                        if !r.status().is_success() {
                            return None;
                        }
                        r.text().await.ok()
                    })
                    .await
                    .ok()
                    .flatten();
                    if let Some(t) = got.as_deref().and_then(cache_tokens) {
                        i.engine.store_cache_tokens(t);
                    }
                    if let Some(b) = got.as_deref().and_then(block_tokens) {
                        i.engine.store_block_tokens(b);
                    }
                    match got.as_deref().and_then(parse) {
                        Some(l) => i.engine.store(l, now_ms()),
                        None => {
                            i.engine.failed();
                            debug!("engine metrics of {} ({url}): no usable answer", i.id);
                        }
                    }
                });
            }
        }
        if !scrapes.is_empty() {
            futures_util::future::join_all(scrapes).await;
        }
        if rt.engine_metrics.is_empty() {
            next = Duration::from_secs(1);
        }
        if !sleep_or_stop(next.max(TICK), &mut stop).await {
            return;
        }
    }
}
