//! The split proxy's legs ([`crate::split`]): the external entry a request was given to, and
//! the failover chain after it. Reasons `split(<entry>)` and `failover(<entry>)`.

use super::{Leg, LegRole, Plan, RemoteLeg, To};
use crate::clock::now_ms;
use crate::error::GatewayError;
use crate::split::Entry;
use std::borrow::Cow;
use std::sync::Arc;

/// A leg to an external entry.
fn leg(e: &Arc<Entry>, why: &str) -> Option<Leg> {
    let endpoint = e.endpoint.clone()?;
    Some(Leg {
        role: LegRole::Main,
        reason: Cow::Owned(format!("{why}({})", e.name)),
        explain: None,
        dispatched: None,
        dispatched_ms: 0,
        to: To::Remote(RemoteLeg {
            endpoint,
            auth: e.bearer.clone(),
            model: e.model.clone(),
            entry: Some(e.clone()),
        }),
    })
}

/// The first leg of a request given to the external entry `e`: `e` itself when available,
/// else (when `e` takes part in failover) the first available participant.
pub fn first(plan: &Plan, e: &Arc<Entry>) -> Result<Vec<Leg>, GatewayError> {
    if e.available(now_ms()) {
        if let Some(l) = leg(e, "split") {
            return Ok(vec![l]);
        }
    }
    if e.failover {
        if let Some(l) = next(plan, std::slice::from_ref(&e.name)) {
            return Ok(vec![l]);
        }
    }
    Err(GatewayError::Unavailable(format!(
        "split.proxies entry {:?} is unavailable ({}){}",
        e.name,
        e.endpoint
            .as_ref()
            .map_or_else(String::new, |x| format!("{} does not resolve", x.origin())),
        if e.failover {
            " and no other entry can take the request"
        } else {
            " and does not fail over (failover: none)"
        }
    )))
}

/// The next failover leg: the first participating external entry not in `tried`.
pub fn next(plan: &Plan, tried: &[String]) -> Option<Leg> {
    let sp = plan.runtime.split.as_ref()?;
    leg(sp.failover(tried, now_ms())?, "failover")
}

/// Whether a failover leg is left after the failed `e`.
pub fn has_next(plan: &Plan, e: &Entry, tried: &[String]) -> bool {
    e.failover
        && plan
            .runtime
            .split
            .as_ref()
            .is_some_and(|sp| sp.failover(tried, now_ms()).is_some())
}

/// Whether a request whose chosen entry is the local one may still go to an external
/// entry: the local entry has `failover: participate` and a participating external entry
/// not in `tried` is available. What our services could not take (no instance, throttled,
/// the queue full) or failed before the first response byte goes there.
pub fn after_local(plan: &Plan, tried: &[String]) -> bool {
    local_participates(plan)
        && plan
            .runtime
            .split
            .as_ref()
            .is_some_and(|sp| sp.failover(tried, now_ms()).is_some())
}

/// The failover leg of a request whose chosen entry is the local one (see [`after_local`]).
pub fn next_after_local(plan: &Plan, tried: &[String]) -> Option<Leg> {
    if !local_participates(plan) {
        return None;
    }
    next(plan, tried)
}

/// The request was given to the local entry, and that entry takes part in failover.
fn local_participates(plan: &Plan) -> bool {
    !matches!(plan.dest, crate::runtime::Dest::Split(_))
        && plan
            .runtime
            .split
            .as_ref()
            .is_some_and(|sp| sp.local().failover)
}

/// Statuses of an external entry that pass the request on (before any byte reached the
/// client).
pub fn fails_over_on(status: u16) -> bool {
    status == 429 || status >= 500
}
