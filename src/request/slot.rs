//! Admission of a planned request to an instance: taking a throttling slot ([`crate::throttle`]).
//!
//! The plan's pipeline picks among instances with a free slot and the leg takes the slot
//! atomically ([`super::plan::pick`]). When every available instance is at its limits (or the
//! service pool is full), the service's `overflow` decides: `reject` refuses at once (429 with
//! `Retry-After`), `queue` waits in the service's queue (FIFO, or by tenant class and fair share:
//! [`crate::throttle`]) — only its head tries for a slot,
//! woken when one is released; a new request queues behind waiting ones — until it gets a
//! slot (the pipeline then picks among the instances with a free slot, so affinity and prefix
//! still apply), the queue is full (429), `queue_timeout` passes (503) or the client hangs up
//! (the waiter leaves the queue; nothing was counted). A refusal may overflow to another
//! region's gateway ([`super::global`]).
//!
//! Then the main leg waits for its turn at its instance while the service's instances are
//! saturated (`engine_queue`, on unless `hold: false`; [`crate::engine_queue`]; [`hold`]).

use super::plan::PickError;
use super::{Leg, Plan};
/// The legs of one attempt (the main leg first).
pub type Legs = Vec<Leg>;
use crate::error::GatewayError;
use crate::runtime::Dest;
use crate::shared::Shared;
use crate::throttle::{Overflow, Refusal, Throttle};
use pingora::prelude::*;
use pingora::proxy::Session;
use std::time::{Duration, Instant};
use tokengate_plugins::InstanceKey;

/// A waiter at the head of the queue checks again this often even without a wake-up (an
/// instance that became healthy, limits raised by a reload).
const RECHECK: Duration = Duration::from_millis(250);

/// Why a request got no slot, and how to answer it.
pub struct Denied {
    pub error: GatewayError,
    /// 429 (limits, queue full) or 503 (queue timeout, nothing available).
    pub status: u16,
    pub retry_after: Option<Duration>,
    /// Local instances cannot take it (a refusal or nothing available): another region may.
    pub overflow: bool,
}

impl Denied {
    fn unavailable(e: GatewayError) -> Denied {
        Denied {
            status: e.status(),
            error: e,
            retry_after: None,
            overflow: true,
        }
    }

    fn refused(shared: &Shared, t: &Throttle, service: &str, r: Refusal) -> Denied {
        let st = t.settings();
        shared
            .metrics
            .throttle_rejections
            .with_label_values(&[service, r.label()])
            .inc();
        let (status, msg, overflow) = match r {
            Refusal::Limit => (
                429,
                format!(
                    "every instance of {service:?} is at its throttling limits (services[].throttling); retry later"
                ),
                true,
            ),
            Refusal::QueueFull => (
                429,
                format!(
                    "the queue of {service:?} is full ({} requests waiting, throttling.max_queue); retry later",
                    st.max_queue
                ),
                true,
            ),
            Refusal::QueueTimeout => (
                503,
                format!(
                    "no slot of {service:?} freed within throttling.queue_timeout ({})",
                    humantime::format_duration(st.queue_timeout)
                ),
                false,
            ),
        };
        let error = if status == 429 {
            GatewayError::TooManyRequests(msg)
        } else {
            GatewayError::QueueTimeout(msg)
        };
        Denied {
            error,
            status,
            // Every refusal is a "come back later", the queue's timeout too.
            retry_after: Some(st.retry_after),
            overflow,
        }
    }
}

/// The classes' names, by [`crate::throttle::Place::class`].
const CLASSES: [&str; 3] = ["interactive", "default", "batch"];

/// The header a request may lower its class with (never above its tenant's).
pub const PRIORITY_HEADER: &str = "x-tokengate-priority";

/// The request's place in a queue: its tenant's class, or the lower one it asks for with
/// [`PRIORITY_HEADER`]; its tenant as the flow; its estimated tokens as the cost.
fn place(plan: &Plan, headers: &http::HeaderMap) -> crate::throttle::Place {
    use crate::config::Priority;
    let tenant = plan.ticket.as_ref().map(|t| &t.tenant);
    let own = tenant.map_or(Priority::Default, |t| t.priority);
    let asked = headers
        .get(PRIORITY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| match v.trim() {
            "interactive" => Some(Priority::Interactive),
            "default" => Some(Priority::Default),
            "batch" => Some(Priority::Batch),
            _ => None,
        });
    let class = asked.map_or(own, |a| a.max(own));
    let info = &plan.info;
    crate::throttle::Place {
        class: class as u8,
        flow: tenant.map_or_else(String::new, |t| t.name.clone()),
        cost: info.prompt_tokens_est
            + info
                .max_tokens
                .unwrap_or(crate::tenants::DEFAULT_OUTPUT_RESERVE),
    }
}

fn service_of(plan: &Plan) -> &str {
    match &plan.dest {
        Dest::Service(s) => &s.name,
        Dest::Route(r) => &r.name,
        Dest::Split(e) => &e.name,
    }
}

/// With `cluster:`, a request of a queueing service that got its slot without queueing
/// counts in its tenant's service all the same (the replicas compare it: fleet-wide
/// fairness, [`crate::throttle`]).
fn served_directly(shared: &Shared, plan: &Plan, headers: &http::HeaderMap) {
    if shared.cluster.is_none() {
        return;
    }
    if let Dest::Service(s) = &plan.dest {
        if let Some(t) = s.throttle.as_ref() {
            if t.settings().overflow == Overflow::Queue {
                let p = place(plan, headers);
                t.served(&p.flow, p.cost);
            }
        }
    }
}

/// Who asks: the client's session (watched while queued: a client that hangs up leaves the
/// queue), or only its headers (a retry inside the proxy, not watched).
pub enum Asker<'a> {
    Client(&'a mut Session),
    Headers(&'a http::HeaderMap),
}

impl Asker<'_> {
    fn headers(&self) -> &http::HeaderMap {
        match self {
            Asker::Client(s) => &s.req_header().headers,
            Asker::Headers(h) => h,
        }
    }
}

/// Takes a slot for the plan's legs (see the module documentation), then waits for the
/// main leg's turn at its instance while the fleet is saturated ([`hold`]). `Err` only when the
/// client left while queued or held.
pub async fn take(
    shared: &Shared,
    mut asker: Asker<'_>,
    plan: &Plan,
    tried: &[InstanceKey],
) -> Result<Result<Legs, Denied>> {
    match take_slot(shared, &mut asker, plan, tried).await? {
        Ok(legs) => Ok(Ok(hold(&mut asker, plan, legs).await?)),
        Err(d) => Ok(Err(d)),
    }
}

/// Whether the client hung up (`true`), or sent bytes after its body (`false`: stop
/// watching); never while not watched.
async fn gone(asker: &mut Asker<'_>, watch: bool) -> bool {
    match asker {
        Asker::Client(s) if watch => s.downstream_session.read_body_or_idle(true).await.is_err(),
        _ => std::future::pending().await,
    }
}

/// The error of a client that hung up `when` (a downstream error: nothing to retry).
fn client_left(when: &'static str) -> Box<Error> {
    Error::explain(
        ErrorType::ConnectionClosed,
        format!("client closed the connection {when}"),
    )
    .into_down()
}

/// The main leg waits for its turn at its instance while every instance of the service is
/// saturated (`scope: service`, the default) or its own is (`scope: instance`)
/// (`services[].engine_queue`, [`crate::engine_queue`]): held with the key arrival + its
/// predicted prefill there, sent when its turn comes (a warm request that would be next goes
/// at once). `Err` only when the client left.
async fn hold(asker: &mut Asker<'_>, plan: &Plan, mut legs: Legs) -> Result<Legs> {
    use crate::engine_queue::Entry;
    let Some(leg) = legs.first_mut() else {
        return Ok(legs);
    };
    let Some(l) = leg.local_mut() else {
        return Ok(legs);
    };
    let st = l.service.engine_queue;
    // A non-stream answer's first token is its last: the gateway cannot see when its prefill
    // ends, so counting it as sent would keep the instance "saturated" through its whole
    // decode. It is neither held nor counted.
    if !st.hold
        || !plan.info.stream
        || l.service.pd.is_some()
        || l.instance.role != tokengate_plugins::Role::Integrated
    {
        return Ok(legs);
    }
    let tps = plan.runtime.cost.prefill_tps(l.instance.key);
    let own_ms = l.uncached_tokens as f64 * 1000.0 / tps;
    // Warm: at least half its prompt cached there (the index's prediction), which the
    // engine keeps for it only once it is sent.
    let prompt = plan.info.prompt_tokens_est;
    let warm = tokengate_plugins::warm(prompt, prompt.saturating_sub(l.uncached_tokens));
    let now = crate::clock::now_ms();
    // `scope: service`: held only while every available instance is saturated (or this one
    // already holds some, checked by `enter`). Its own instance first: below overload it
    // has room and the others are not looked at.
    let fleet_full = st.scope == crate::engine_queue::Scope::Instance
        || l.instance.queue.full(&st)
            && l.service.instances.iter().all(|i| {
                i.role != tokengate_plugins::Role::Integrated
                    || !i.health.available(now)
                    || i.queue.full(&st)
            });
    let waiter = match l
        .instance
        .queue
        .enter(st, own_ms, l.uncached_tokens, now, warm, fleet_full)
    {
        Entry::Sent(slot) => {
            l.sent = Some(slot);
            return Ok(legs);
        }
        Entry::Held(w) => w,
    };
    // The index learns where the prompt goes now, not when it is sent: the next request
    // sharing its prefix (another session of its tenant) follows it instead of being placed
    // as cold elsewhere while it waits.
    l.service
        .index
        .insert(&plan.blocks, l.instance.key, crate::clock::now_ms());
    let behind = waiter.held();
    let turn = waiter.sent();
    tokio::pin!(turn);
    let mut watch = matches!(asker, Asker::Client(_));
    let slot = loop {
        tokio::select! {
            slot = &mut turn => break slot,
            left = gone(asker, watch) => {
                if left {
                    return Err(client_left("while held for its instance"));
                }
                watch = false;
            }
        }
    };
    // What was queued ahead of it is what was sent ahead (the rate it teaches).
    l.queued_ahead = slot.ahead_tokens;
    if let Some(x) = leg.explain.as_mut() {
        use std::fmt::Write;
        let _ = write!(
            x,
            " held={}ms(own={:.0}ms, {} held with it)",
            slot.held.as_millis(),
            own_ms,
            behind.saturating_sub(1)
        );
    }
    if let Some(l) = leg.local_mut() {
        l.sent = Some(slot);
    }
    Ok(legs)
}

/// [`take`] without the hold.
async fn take_slot(
    shared: &Shared,
    asker: &mut Asker<'_>,
    plan: &Plan,
    tried: &[InstanceKey],
) -> Result<Result<Legs, Denied>> {
    // The session's binding in the fleet, before the pipeline looks at it.
    // (Boxed: without `cluster:` a request's state does not carry this future's.)
    if shared.cluster.is_some() {
        Box::pin(super::cluster::fetch_session(shared, plan, asker.headers())).await;
    }
    // While requests wait for this service, a newcomer queues (behind them, or where its
    // class and its tenant's share put it).
    let waiting = match &plan.dest {
        Dest::Service(s) => s
            .throttle
            .clone()
            .filter(|t| t.settings().overflow == Overflow::Queue && t.queued() > 0),
        Dest::Route(_) | Dest::Split(_) => None,
    };
    let throttle = match waiting {
        Some(t) => t,
        None => match super::cluster::pick(shared, plan, asker.headers(), tried).await {
            Ok(leg) => {
                served_directly(shared, plan, asker.headers());
                return Ok(Ok(leg));
            }
            Err(PickError::Unavailable(e)) => return Ok(Err(Denied::unavailable(e))),
            Err(PickError::Throttled(t)) => t,
        },
    };
    let service = service_of(plan).to_string();
    let st = throttle.settings();
    if st.overflow == Overflow::Reject {
        return Ok(Err(Denied::refused(
            shared,
            &throttle,
            &service,
            Refusal::Limit,
        )));
    }
    let place = place(plan, asker.headers());
    let class_wait = shared
        .metrics
        .tenants
        .queue_wait
        .with_label_values(&[CLASSES[usize::from(place.class).min(2)]]);
    let ticket = match throttle.enqueue_at(&place) {
        Ok(t) => t,
        Err(r) => return Ok(Err(Denied::refused(shared, &throttle, &service, r))),
    };
    let queued_at = Instant::now();
    let deadline = tokio::time::Instant::now() + st.queue_timeout;
    let wait = &shared.metrics.throttle_queue_wait;
    let mut watch = matches!(asker, Asker::Client(_));
    loop {
        if ticket.may_try() {
            match super::cluster::pick(shared, plan, asker.headers(), tried).await {
                Ok(leg) => {
                    ticket.granted();
                    wait.with_label_values(&[&service])
                        .observe(queued_at.elapsed().as_secs_f64());
                    class_wait.observe(queued_at.elapsed().as_secs_f64());
                    return Ok(Ok(leg)); // leaving the queue wakes the next waiter
                }
                Err(PickError::Unavailable(e)) => return Ok(Err(Denied::unavailable(e))),
                Err(PickError::Throttled(_)) => {}
            }
        }
        let gone = gone(asker, watch);
        tokio::select! {
            _ = ticket.woken() => {}
            _ = tokio::time::sleep(RECHECK) => {}
            _ = tokio::time::sleep_until(deadline) => {
                wait.with_label_values(&[&service])
                    .observe(queued_at.elapsed().as_secs_f64());
                class_wait.observe(queued_at.elapsed().as_secs_f64());
                return Ok(Err(Denied::refused(
                    shared,
                    &throttle,
                    &service,
                    Refusal::QueueTimeout,
                )));
            }
            left = gone => {
                if left {
                    return Err(client_left("while queued for a slot"));
                }
                // Unexpected bytes after the body (pipelining): stop watching.
                watch = false;
            }
        }
    }
}
