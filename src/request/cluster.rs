//! A request's part in the replicas' shared state ([`crate::cluster`]), when `cluster:` is
//! configured (without it every function here returns at once):
//!
//! * before picking: the session's fleet binding, read from Redis and applied to the local
//!   session table, so the affinity layer sees where another replica sent its last turn;
//! * after picking, on a throttled service: the fleet-wide slot of the picked instance (a
//!   lease); an instance whose fleet slots are all taken is excluded and the pipeline picks
//!   again (book, then verify: the script books only under the limit, so two replicas never
//!   both get the last slot);
//! * at dispatch: the placement of the prompt's blocks and the session's binding, sent off
//!   the request's path.

use super::plan::{self, PickError};
use super::{ChosenBy, LocalLeg, Plan, To};
use crate::cluster::{Acquired, Cluster};
use crate::runtime::Dest;
use crate::shared::Shared;
use crate::throttle::Scope;
use std::sync::Arc;
use tokengate_plugins::{InstanceKey, Role};

/// The name of a scheduler's session table in Redis (see [`Dest::session_target`]).
fn scope(by: &ChosenBy) -> Option<String> {
    match by {
        ChosenBy::Service(s) => Some(crate::runtime::service_sessions(&s.name)),
        ChosenBy::Route(r) => Some(crate::runtime::route_sessions(&r.name)),
        ChosenBy::Decode => None,
    }
}

/// Reads the session's binding in the fleet and applies it to the local table (the one
/// Redis round trip of an unthrottled request; none without a session key, and none when
/// the tenant's fleet-wide admission read it along, see [`super::admit`]).
pub async fn fetch_session(shared: &Shared, plan: &Plan, headers: &http::HeaderMap) {
    let Some(c) = shared.cluster.as_ref() else {
        return;
    };
    let Some((name, s)) = plan.dest.session_target(headers, &plan.info, plan.api) else {
        return;
    };
    let (table, instances): (_, Vec<&Arc<crate::runtime::Instance>>) = match &plan.dest {
        Dest::Service(s) => (s.sched.sessions.as_ref(), s.instances.iter().collect()),
        Dest::Route(r) => (
            r.scheduler().and_then(|s| s.sessions.as_ref()),
            r.targets.iter().flat_map(|s| s.instances.iter()).collect(),
        ),
        Dest::Split(_) => return,
    };
    let Some(table) = table else { return };
    let prefetched = plan
        .fleet_session
        .as_deref()
        .filter(|(n, k, _)| *n == name && *k == s)
        .map(|(_, _, bound)| bound.clone());
    let bound = match prefetched {
        Some(bound) => bound,
        None => c.session(&name, s).await,
    };
    let Some(id) = bound else {
        return;
    };
    if let Some(i) = instances.iter().find(|i| i.id == id) {
        let now = crate::clock::now_ms();
        if table.get(s, now) != Some(i.key) {
            table.bind(s, i.key, now);
        }
    }
}

/// The fleet-wide slots a leg needs: (phase, instance part of the key, limit).
fn slots(leg: &LocalLeg, now: u64) -> Vec<(&'static str, String, u64)> {
    let Some(t) = leg.service.throttle.as_ref() else {
        return Vec::new();
    };
    let st = t.settings();
    let inst = &leg.instance;
    let (who, times) = match st.scope {
        Scope::Instance => (inst.id.clone(), 1),
        Scope::Service => {
            let n = leg
                .service
                .instances
                .iter()
                .filter(|i| i.role == inst.role && i.health.available(now))
                .count()
                .max(1) as u64;
            (format!("*{}", inst.role.as_str()), n)
        }
    };
    let mut out = Vec::new();
    match inst.role {
        Role::Decode if st.decode > 0 => out.push(("decode", who, st.decode * times)),
        Role::Decode => {}
        Role::Prefill | Role::Integrated => {
            if st.limits.prefill > 0 {
                out.push(("prefill", who.clone(), st.limits.prefill * times));
            }
            if inst.role == Role::Integrated && st.limits.total > 0 {
                out.push(("total", who, st.limits.total * times));
            }
        }
    }
    out
}

/// Takes the fleet-wide slots of every leg; `Err(instance)` when the fleet has none left
/// on that instance (the legs are then dropped by the caller: their local slots return).
async fn lease(c: &Arc<Cluster>, legs: &mut [super::Leg]) -> Result<(), InstanceKey> {
    let now = crate::clock::now_ms();
    for leg in legs.iter_mut() {
        let To::Local(l) = &mut leg.to else { continue };
        for (phase, who, limit) in slots(l, now) {
            match c.acquire(&l.service.name, &who, phase, limit).await {
                Acquired::Slot(lease) => l.leases.push(lease),
                Acquired::Full => return Err(l.instance.key),
                // Redis gone: the local limits alone hold (degraded).
                Acquired::Unknown => return Ok(()),
            }
        }
    }
    Ok(())
}

/// [`plan::pick`], then the fleet-wide slots of a throttled service: an instance whose
/// slots the fleet uses up is excluded and the pipeline picks again; when none is left the
/// request is throttled (it queues or is refused as the service says).
pub async fn pick(
    shared: &Shared,
    plan: &Plan,
    headers: &http::HeaderMap,
    tried: &[InstanceKey],
) -> Result<Vec<super::Leg>, PickError> {
    let mut legs = plan::pick(plan, headers, tried)?;
    let Some(c) = shared.cluster.as_ref() else {
        return Ok(legs);
    };
    let mut full: Vec<InstanceKey> = Vec::new();
    loop {
        match lease(c, &mut legs).await {
            Ok(()) => return Ok(legs),
            Err(k) => {
                let throttle = legs.iter().find_map(|l| match &l.to {
                    To::Local(l) => l.service.throttle.clone(),
                    To::Remote(_) => None,
                });
                drop(legs);
                full.push(k);
                let excluded: Vec<InstanceKey> = tried.iter().chain(&full).copied().collect();
                legs = match plan::pick(plan, headers, &excluded) {
                    Ok(l) => l,
                    Err(PickError::Unavailable(_)) | Err(PickError::Throttled(_)) => {
                        return Err(match throttle {
                            Some(t) => PickError::Throttled(t),
                            None => {
                                PickError::Unavailable(crate::error::GatewayError::Unavailable(
                                    "every instance is at its fleet-wide limits".into(),
                                ))
                            }
                        });
                    }
                };
            }
        }
    }
}

/// Tells the other replicas about a dispatch: the prompt's blocks on the instance (their
/// prefix indexes) and the session's binding (their affinity layers).
pub fn dispatched(shared: &Shared, plan: &Plan, l: &LocalLeg) {
    let Some(c) = shared.cluster.as_ref() else {
        return;
    };
    c.placed(&l.service.name, &l.instance.id, &plan.blocks);
    let (Some(s), Some(sched)) = (l.session, l.by.scheduler()) else {
        return;
    };
    let Some(table) = sched.sessions.as_ref() else {
        return;
    };
    let now = crate::clock::now_ms();
    if table.get(s, now) == Some(l.instance.key) {
        if let Some(name) = scope(&l.by) {
            c.bind(&name, s, &l.instance.id, table.config().ttl_ms);
        }
    }
}

/// Tells the other replicas about a self-correcting trim.
pub fn trimmed(shared: &Shared, plan: &Plan, l: &LocalLeg, keep: usize) {
    if let Some(c) = shared.cluster.as_ref() {
        c.trimmed(&l.service.name, &l.instance.id, &plan.blocks, keep);
    }
}
