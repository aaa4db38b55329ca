//! The cluster's background work ([`crate::cluster::run`]) with what applies the other
//! replicas' events to this replica's state: their placements and trims to the services'
//! prefix indexes, their released slots to the throttling queues; and the exchange of the
//! replicas' in-flight figures and throttling queues' figures (fleet-wide fairness).

use crate::cluster::{Cluster, Event, FlowFigures, Kind};
use crate::shared::Shared;
use crate::throttle::Remote;
use std::collections::HashMap;
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

/// Every [`Cluster::load_every`], in one round trip: this replica's in-flight figures out,
/// the other replicas' in, into each instance's [`crate::load::RemoteLoad`] (zero while
/// Redis is away: stale figures would steer requests away from instances that emptied
/// meanwhile); and the same for the throttling queues' figures per tenant, into each
/// queueing service's [`crate::throttle::Throttle::set_fleet`] (none while Redis is away:
/// fair per replica, the requests granted meanwhile counted as local fallbacks).
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
        let mut fair = Vec::new();
        let mut granted = 0;
        let queues: Vec<_> = rt
            .ordered
            .iter()
            .filter_map(|s| {
                let t = s.throttle.as_ref()?;
                (t.settings().overflow == crate::throttle::Overflow::Queue).then_some((s, t))
            })
            .collect();
        for (s, t) in &queues {
            let (flows, n) = t.fleet_report();
            granted += n;
            fair.extend(flows.into_iter().map(|f| FlowFigures {
                service: s.name.clone(),
                flow: f.flow,
                served: f.served,
                backlog: f.backlog,
                class: f.class,
            }));
        }
        let mut others = c.sync(&own, &fair).await;
        if others.is_none() && granted > 0 {
            c.fairness_fallbacks(granted);
        }
        for i in rt.ordered.iter().flat_map(|s| s.instances.iter()) {
            let v = others
                .as_ref()
                .and_then(|o| o.load.get(&i.id).copied())
                .unwrap_or_default();
            i.remote.set(v);
        }
        let mut by_service: HashMap<String, HashMap<String, Remote>> = HashMap::new();
        if let Some(o) = others.as_mut() {
            for ((service, flow), (served, backlog, class)) in o.fair.drain() {
                by_service.entry(service).or_default().insert(
                    flow,
                    Remote {
                        served,
                        backlog,
                        class,
                    },
                );
            }
        }
        for (s, t) in &queues {
            t.set_fleet(by_service.remove(&s.name).unwrap_or_default());
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
