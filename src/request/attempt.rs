//! The request's attempts: what comes after an attempt that failed before any response byte
//! reached the client, or after an admission refusal. One home for "where does the request
//! go next", whatever the failed leg was:
//!
//! | failed leg | failure | next |
//! |---|---|---|
//! | our instance | a status of `passive_health.retry_on_status`, a refused or reset connection, a failed prefill | another instance ([`Next::Local`]; within [`MAX_ATTEMPTS`], a fresh throttling slot) |
//! | our instance, none left (or a timeout, never retried here: it would multiply the wait) | 5xx, 429, connect error, reset, timeout | the first `failover: participate` external entry, when the split proxy's local entry participates ([`Next::Entry`]) |
//! | an external entry (`split.proxies`) with `failover: participate` | 5xx, 429, any error before the answer | the next participating entry ([`Next::Entry`]) |
//! | a member gateway (`global.members`) | 429, 503, a refused or reset connection | the next member ([`Next::Member`]) |
//!
//! An admission refusal (no instance available, throttling rejects, the queue is full) goes
//! to a member gateway (unless the request already crossed a region), else to the external
//! entries when the split proxy's local entry participates ([`after_refusal`]).
//!
//! The failure hooks ([`super::dispatch`]) ask [`after_failure`] and keep its answer in the
//! request's [`State`]; Pingora then calls `upstream_peer` again, where [`retry`] ends the
//! failed attempt ([`super::complete::attempt_failed`]) and picks the next leg(s)
//! (`next_legs`). A disaggregated pair whose prefill failed before the decode was sent
//! goes the same way ([`prefill_failed`]).

use super::slot::{self, Denied, Legs};
use super::{complete, global, pd, split, Ctx, Leg, Plan};
use crate::error::GatewayError;
use crate::runtime::Dest;
use crate::shared::Shared;
use pingora::prelude::*;

/// A Pingora error that `fail_to_proxy` turns into this gateway error.
pub fn gw_err(e: GatewayError) -> Box<Error> {
    Error::explain(ErrorType::HTTPStatus(e.status()), e.to_string())
}

/// Attempts on our own instances per request (first try + retries to other instances).
pub const MAX_ATTEMPTS: usize = 3;

pub use super::tries::{Failure, Next, State};

/// The next attempt after the current one failed with `f`, or `None`: the failure is the
/// answer. See the module documentation.
pub fn after_failure(ctx: &Ctx, plan: &Plan, f: Failure) -> Option<Next> {
    if let Some(r) = ctx.main_leg().and_then(|l| l.remote()) {
        return match &r.entry {
            Some(e) => {
                let moves = match f {
                    Failure::Status(s) => split::fails_over_on(s),
                    _ => true,
                };
                (moves && split::has_next(plan, e, &ctx.attempt.tried_remote))
                    .then_some(Next::Entry)
            }
            None => {
                let moves = match f {
                    Failure::Status(s) => global::REFUSALS.contains(&s),
                    Failure::Connect | Failure::Reset => true,
                    _ => false,
                };
                (moves && global::has_next(plan, &ctx.attempt.tried_remote)).then_some(Next::Member)
            }
        };
    }
    let retried_here = match f {
        Failure::Status(s) => plan.runtime.passive.retry_on_status.contains(&s),
        Failure::Connect | Failure::Reset | Failure::Prefill => true,
        Failure::Timeout | Failure::Other => false,
    };
    if retried_here && local_left(ctx, plan) {
        return Some(Next::Local);
    }
    let fails_over = match f {
        Failure::Status(s) => split::fails_over_on(s),
        Failure::Other => false,
        _ => true,
    };
    (fails_over && split::after_local(plan, &ctx.attempt.tried_remote)).then_some(Next::Entry)
}

/// Whether another of our instances may be tried: attempts left and an untried available
/// instance. A disaggregated service's failed pair blames one of its instances (see
/// [`super::pd`]): the other one may be used again.
fn local_left(ctx: &Ctx, plan: &Plan) -> bool {
    if ctx.attempt.count >= MAX_ATTEMPTS {
        return false;
    }
    match ctx.pd.as_ref() {
        Some(a) => {
            let mut excluded = ctx.attempt.tried.clone();
            excluded.push(a.blamed());
            plan.dest.has_untried(&excluded)
        }
        None => plan.dest.has_untried(&ctx.attempt.tried),
    }
}

/// Where a request goes that our instances refused (`d`), or `None`: the refusal is the
/// answer. A member gateway first (not for a request that already crossed a region), else
/// an external entry when the split proxy's local entry takes part in failover.
pub fn after_refusal(plan: &Plan, d: &Denied, tried_members: &[String]) -> Option<Leg> {
    if !d.overflow || matches!(plan.dest, Dest::Split(_)) {
        return None;
    }
    (!plan.hop)
        .then(|| global::leg(plan, tried_members))
        .flatten()
        .or_else(|| split::next_after_local(plan, tried_members))
}

/// The first attempt's legs: a throttling slot on one of our instances (waiting in the
/// queue, watching the client), or where a refusal goes. `Err` only when the client left
/// while queued.
pub async fn admit(
    shared: &Shared,
    session: &mut pingora::proxy::Session,
    plan: &Plan,
) -> Result<Result<Legs, Denied>> {
    Ok(
        match slot::take(shared, slot::Asker::Client(session), plan, &[]).await? {
            Ok(legs) => Ok(legs),
            Err(d) => match after_refusal(plan, &d, &[]) {
                Some(leg) => Ok(vec![leg]),
                None => Err(d),
            },
        },
    )
}

/// `upstream_peer` after a failed attempt: completes it and picks the next attempt's legs
/// where [`after_failure`] said (or, for a retry Pingora decided on its own, the same kind
/// of upstream).
pub async fn retry(
    shared: &Shared,
    headers: &http::HeaderMap,
    ctx: &mut Ctx,
    plan: &Plan,
) -> Result<()> {
    let retried = ctx.response.retry_status.take();
    ctx.response.answered = false;
    let same = match ctx.main_leg().and_then(|l| l.remote()) {
        Some(r) if r.entry.is_some() => Next::Entry,
        Some(_) => Next::Member,
        None => Next::Local,
    };
    let next = ctx.attempt.next.take().unwrap_or(same);
    complete::attempt_failed(shared, ctx, plan, retried);
    ctx.legs = next_legs(shared, headers, ctx, plan, next).await?;
    Ok(())
}

/// A disaggregated pair's prefill failed before its decode was sent (vLLM): completes the
/// attempt and picks the next one's legs, or answers with the prefill's error.
pub async fn prefill_failed(
    shared: &Shared,
    headers: &http::HeaderMap,
    ctx: &mut Ctx,
    plan: &Plan,
    f: pd::Failure,
) -> Result<()> {
    let prefill = ctx.pd.as_ref().map(|a| a.prefill.id.clone());
    let next = f
        .retryable()
        .then(|| after_failure(ctx, plan, Failure::Prefill))
        .flatten();
    complete::attempt_failed(shared, ctx, plan, None);
    match next {
        Some(n) => {
            ctx.legs = next_legs(shared, headers, ctx, plan, n).await?;
            Ok(())
        }
        None => Err(gw_err(
            f.gateway_error(prefill.as_deref().unwrap_or("-"), &ctx.request_id),
        )),
    }
}

/// The next attempt's legs (the failed attempt was completed), or the error to answer with.
async fn next_legs(
    shared: &Shared,
    headers: &http::HeaderMap,
    ctx: &Ctx,
    plan: &Plan,
    next: Next,
) -> Result<Legs> {
    match next {
        Next::Entry => match split::next(plan, &ctx.attempt.tried_remote) {
            Some(l) => Ok(vec![l]),
            None => Err(gw_err(GatewayError::BadGateway(format!(
                "no split.proxies entry could take the request ({} tried: {})",
                ctx.attempt.tried_remote.len(),
                ctx.attempt.tried_remote.join(", ")
            )))),
        },
        Next::Member => match global::leg(plan, &ctx.attempt.tried_remote) {
            Some(l) => Ok(vec![l]),
            None => Err(gw_err(GatewayError::Unavailable(format!(
                "no gateway of another region took the request ({} tried)",
                ctx.attempt.tried_remote.len()
            )))),
        },
        Next::Local => {
            if ctx.attempt.count >= MAX_ATTEMPTS {
                return Err(gw_err(GatewayError::BadGateway(format!(
                    "{} attempts to reach an instance of {:?} failed",
                    ctx.attempt.count,
                    plan.dest.name()
                ))));
            }
            // A retry re-takes a slot (the failed attempt gave its slot back), waiting in the
            // queue in queue mode; a refusal goes where an admission refusal goes.
            match slot::take(
                shared,
                slot::Asker::Headers(headers),
                plan,
                &ctx.attempt.tried,
            )
            .await?
            {
                Ok(legs) => Ok(legs),
                Err(d) => match after_refusal(plan, &d, &ctx.attempt.tried_remote) {
                    Some(leg) => Ok(vec![leg]),
                    None => Err(gw_err(d.error)),
                },
            }
        }
    }
}
