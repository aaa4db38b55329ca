//! Global scheduling: a request this gateway cannot take (throttling would reject it, its
//! queue is full, no instance is available) goes to a member gateway in another region
//! (`global.members`), with the member's token as its API key and the `x-tokengate-hop`
//! header. Members are tried in order, skipping ones that are down (active health checks, or
//! a name that does not resolve) and ones that answered 429 or 503 for this request. A request
//! that already crossed a region (it carries the hop header) is never forwarded again: two
//! gateways that list each other do not ping-pong. Reason `global(<member>)`.

use super::{Leg, LegRole, Plan, RemoteLeg, To};
use crate::clock::now_ms;
use std::borrow::Cow;

/// The header a forwarded request carries (its value: the forwarding gateway's name).
pub const HOP_HEADER: &str = "x-tokengate-hop";

/// Statuses of a member that send the request on to the next member.
pub const REFUSALS: [u16; 2] = [429, 503];

/// A leg to the first available member not in `tried` (member names).
pub fn leg(plan: &Plan, tried: &[String]) -> Option<Leg> {
    let now = now_ms();
    let m = plan
        .runtime
        .members
        .iter()
        .find(|m| !tried.contains(&m.endpoint.name) && m.endpoint.available(now))?;
    Some(Leg {
        role: LegRole::Main,
        reason: Cow::Owned(format!("global({})", m.endpoint.name)),
        explain: None,
        dispatched: None,
        dispatched_ms: 0,
        to: To::Remote(RemoteLeg {
            endpoint: m.endpoint.clone(),
            auth: m.auth.clone(),
            model: None,
            entry: None,
        }),
    })
}

/// Whether another member could still be tried.
pub fn has_next(plan: &Plan, tried: &[String]) -> bool {
    let now = now_ms();
    plan.runtime
        .members
        .iter()
        .any(|m| !tried.contains(&m.endpoint.name) && m.endpoint.available(now))
}
