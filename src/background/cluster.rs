//! The cluster's background work ([`crate::cluster::run`]) with what applies the other
//! replicas' events to this replica's state: their placements and trims to the services'
//! prefix indexes, their released slots to the throttling queues.

use crate::cluster::{Cluster, Event, Kind};
use crate::shared::Shared;
use std::sync::Arc;

pub async fn run(shared: Arc<Shared>, c: Arc<Cluster>, stop: pingora::server::ShutdownWatch) {
    let load = tokio::spawn(share_load(shared.clone(), c.clone(), stop.clone()));
    let counted = c.clone();
    let apply = move |e: Event| {
        if let Some(kind) = apply(&shared, &e) {
            counted.count_applied(kind);
        }
    };
    crate::cluster::run(c, apply, stop).await;
    load.abort();
}

/// Every [`Cluster::load_every`]: this replica's in-flight figures out, the other replicas'
/// in, into each instance's [`crate::load::RemoteLoad`] (zero while Redis is away: stale
/// figures would steer requests away from instances that emptied meanwhile).
async fn share_load(
    shared: Arc<Shared>,
    c: Arc<Cluster>,
    mut stop: pingora::server::ShutdownWatch,
) {
    loop {
        let rt = shared.runtime.load_full();
        let own: Vec<(String, [u64; 4])> = rt
            .ordered
            .iter()
            .flat_map(|s| s.instances.iter())
            .filter_map(|i| {
                let l = i.load.snapshot();
                let v = [
                    l.inflight_requests,
                    l.inflight_tokens,
                    l.waiting,
                    l.prefill_tokens,
                ];
                (v != [0; 4]).then(|| (i.id.clone(), v))
            })
            .collect();
        let others = c.sync_load(&own).await;
        for i in rt.ordered.iter().flat_map(|s| s.instances.iter()) {
            let v = others
                .as_ref()
                .and_then(|o| o.get(&i.id).copied())
                .unwrap_or_default();
            i.remote.set(v);
        }
        if !crate::clock::sleep_or_stop(c.load_every(), &mut stop).await {
            return;
        }
    }
}

/// Applies another replica's event; the kind applied (`None`: nothing here matches it).
fn apply(shared: &Shared, e: &Event) -> Option<&'static str> {
    let rt = shared.runtime.load();
    let svc = rt.services.get(&e.service)?;
    let now = crate::clock::now_ms();
    match e.kind {
        Kind::Placed | Kind::Trimmed { .. } => {
            let inst = svc.instances.iter().find(|i| i.id == e.instance)?;
            if let Kind::Trimmed { keep } = e.kind {
                svc.index.trim(&e.blocks, inst.key, keep as usize);
                svc.index.insert(&e.blocks, inst.key, now);
                Some("trimmed")
            } else {
                svc.index.insert(&e.blocks, inst.key, now);
                inst.bound_index(&svc.index, rt.block_tokens);
                Some("placed")
            }
        }
        Kind::Released => {
            svc.throttle.as_ref()?.kick();
            Some("released")
        }
    }
}
