//! The cluster's background work ([`crate::cluster::run`]) with what applies the other
//! replicas' events to this replica's state: their placements and trims to the services'
//! prefix indexes, their released slots to the throttling queues.

use crate::cluster::{Cluster, Event, Kind};
use crate::shared::Shared;
use std::sync::Arc;

pub async fn run(shared: Arc<Shared>, c: Arc<Cluster>, stop: pingora::server::ShutdownWatch) {
    let counted = c.clone();
    let apply = move |e: Event| {
        if let Some(kind) = apply(&shared, &e) {
            counted.count_applied(kind);
        }
    };
    crate::cluster::run(c, apply, stop).await;
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
