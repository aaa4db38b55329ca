//! One request's lifecycle, in four phases with one home each. Pingora's hooks
//! ([`crate::proxy`]) only call them.
//!
//! | phase | module | Pingora hook | what |
//! |---|---|---|---|
//! | **admit** | [`admit`] | `request_filter` | local endpoints, head limits, method, auth, the body read (bounded, timed) and parsed |
//! | **plan** | [`plan`] | `request_filter` | model → service or route, the decision service, the prompt's blocks, picking the instance(s): a [`Leg`] per upstream, each holding its own load guard |
//! | **dispatch** | [`dispatch`] | `upstream_peer` … `response_body_filter` | each leg to its engine (peer, headers, body), retries to another instance, the response observed as it streams: first token, usage |
//! | **complete** | [`complete`] | `logging` | each leg's outcome into the load table, passive health, the scheduler (session) and the prefix index; metrics; the access-log line; the request's followers ([`crate::hook`]) |
//!
//! Between them, [`attempt`] is the request's state machine: the first attempt's legs (a
//! throttling slot, or where a refusal goes), and after an attempt that failed before the
//! first response byte, where the next one goes — another of our instances, the next
//! split-proxy entry, the next member gateway — for every kind of leg, in one place.
//!
//! Bodies above Pingora's 64 KiB retry buffer go through the same phases: the main request
//! admits and plans, then hands the plan and its legs to a subrequest ([`crate::bigbody`])
//! whose hooks dispatch and complete.

pub mod admit;
pub mod attempt;
pub mod cluster;
pub mod complete;
pub mod dispatch;
pub mod global;
pub mod linger;
pub mod pd;
pub mod plan;
pub mod slot;
pub mod split;
pub mod tries;

use crate::api::{Api, RequestInfo};
use crate::load::LoadGuard;
use crate::runtime::{Dest, Instance, Route, Runtime, Service};
use crate::usage::{JsonCollector, SseScanner, Usage};
use bytes::Bytes;
use http::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::Session;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokengate_plugins::{Candidate, SessionKey};

/// A planned request: what every attempt and every leg needs.
pub struct Plan {
    pub api: Api,
    pub info: Arc<RequestInfo>,
    /// The service or route the request's `model` resolved to.
    pub dest: Dest,
    /// The decision service's choice of target (routes with a decision-service plugin).
    pub decision: Option<u32>,
    /// The decision-service call, when one was made: when it started, how long it took, its
    /// outcome's label (`target`, `timeout`, `error`, `no_target`) and the provider's model.
    pub decision_call: Option<DecisionCall>,
    pub runtime: Arc<Runtime>,
    pub start: Instant,
    pub request_id: String,
    /// The prompt's chained block hashes (prefix index key).
    pub blocks: Vec<u64>,
    /// The gateway added `stream_options.include_usage`; remove the usage chunk downstream.
    pub strip_usage: bool,
    /// Forward the client's Authorization / x-api-key headers (gateway auth disabled).
    pub forward_auth: bool,
    /// The request came from another region's gateway: it is never forwarded again.
    pub hop: bool,
    /// Its hold on its tenant's limits, settled when the request completes.
    pub ticket: Option<crate::tenants::Ticket>,
    /// The session's fleet binding read along with the tenant's fleet-wide admission
    /// (`cluster:`): the table's name in Redis, the session, the instance id bound.
    /// (Boxed: every request's state carries the field, few requests a value.)
    pub fleet_session: Option<Box<(String, tokengate_plugins::SessionKey, Option<String>)>>,
}

/// A decision-service call of a plan (for its trace span).
pub struct DecisionCall {
    pub started: Instant,
    pub latency: Duration,
    pub outcome: &'static str,
    pub model: String,
}

/// Which scheduler chose a leg (to tell it how the request ended).
#[derive(Clone)]
pub enum ChosenBy {
    Service(Arc<Service>),
    Route(Arc<Route>),
    /// A disaggregated service's decode picker (stateless load balancing: nothing to tell).
    Decode,
}

impl ChosenBy {
    pub fn scheduler(&self) -> Option<&crate::pipelines::Scheduler> {
        match self {
            ChosenBy::Service(s) => Some(&s.sched),
            ChosenBy::Route(r) => r.scheduler(),
            ChosenBy::Decode => None,
        }
    }
}

/// What a leg is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LegRole {
    /// The upstream whose response the client receives (a disaggregated service's decode
    /// instance).
    Main,
    /// A disaggregated service's prefill instance ([`pd`]).
    Prefill,
}

/// A leg's hold on its instance's load: its own guard, or (a prefill leg once dispatched)
/// shared with the task that reads the prefill's response ([`pd::side::Side`]).
pub enum Guard {
    Held(LoadGuard<Instance>),
    Shared(Arc<pd::side::Side>),
    /// Only while being moved.
    Gone,
}

impl Guard {
    pub fn first_token(&mut self) {
        match self {
            Guard::Held(g) => g.first_token(),
            Guard::Shared(s) => s.first_token(),
            Guard::Gone => {}
        }
    }

    pub fn finish(self, o: crate::load::Outcome) {
        match self {
            Guard::Held(g) => g.finish(o),
            Guard::Shared(s) => s.finish(o),
            Guard::Gone => {}
        }
    }
}

/// Prefix-cache figures of one decision, in blocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefixFigures {
    pub prompt_blocks: u32,
    /// The chosen instance's match (predicted hit).
    pub matched: u32,
    /// The best match over the candidates (the ceiling).
    pub best: u32,
}

/// One upstream of a request: where it goes, why, and (for our own instances) the load it
/// holds there (released exactly once, whatever happens: [`LoadGuard`]).
pub struct Leg {
    pub role: LegRole,
    pub to: To,
    pub reason: Cow<'static, str>,
    /// One line with every candidate's numbers (built only when debug logging is on).
    pub explain: Option<String>,
    /// When the leg was sent (set by dispatch), and the same on the gateway's clock.
    pub dispatched: Option<Instant>,
    pub dispatched_ms: u64,
}

/// Where a leg goes.
// Nearly every leg is `Local`: boxing it would cost an allocation per request to save the
// bytes of the rare `Remote` legs.
#[allow(clippy::large_enum_variant)]
pub enum To {
    /// An instance of one of our services.
    Local(LocalLeg),
    /// Another gateway (global scheduling) or an external API (split proxy).
    Remote(RemoteLeg),
}

/// A leg to one of our instances.
pub struct LocalLeg {
    pub service: Arc<Service>,
    pub instance: Arc<Instance>,
    pub by: ChosenBy,
    /// The instance as the pipeline saw it.
    pub cand: Candidate,
    pub session: Option<SessionKey>,
    pub prefix: PrefixFigures,
    pub guard: Guard,
    /// The name shown instead of the instance id (a prefill/decode pair: `p1+d1`), and as
    /// the `x-tokengate-instance` header value.
    pub label: Option<(String, HeaderValue)>,
    /// Prefill tokens queued on the instance (by this gateway) when the leg was picked.
    pub queued_ahead: u64,
    /// This request's uncached prompt tokens there, as the index predicted them.
    pub uncached_tokens: u64,
    /// Its fleet-wide throttling slots (`cluster:`), given back when dropped.
    pub leases: Vec<crate::cluster::Lease>,
    /// Its place among the requests sent to a saturated instance (`engine_queue`), given
    /// back at its first token or when dropped.
    pub sent: Option<crate::engine_queue::Slot>,
}

/// A leg to another gateway or an external API.
pub struct RemoteLeg {
    pub endpoint: Arc<crate::upstream::Endpoint>,
    /// `Authorization` to send (the member's token, the external API's key).
    pub auth: Option<HeaderValue>,
    /// Replaces the request's `model` (external APIs with `model:` set).
    pub model: Option<String>,
    /// The split proxy's entry (`None`: a member gateway of global scheduling).
    pub entry: Option<Arc<crate::split::Entry>>,
}

impl Leg {
    /// Bounded label for the decisions counter: the reason up to its first parenthesis.
    pub fn metric_reason(&self) -> &str {
        let r: &str = &self.reason;
        r.split('(').next().unwrap_or(r)
    }

    pub fn local(&self) -> Option<&LocalLeg> {
        match &self.to {
            To::Local(l) => Some(l),
            To::Remote(_) => None,
        }
    }

    pub fn local_mut(&mut self) -> Option<&mut LocalLeg> {
        match &mut self.to {
            To::Local(l) => Some(l),
            To::Remote(_) => None,
        }
    }

    pub fn remote(&self) -> Option<&RemoteLeg> {
        match &self.to {
            To::Remote(r) => Some(r),
            To::Local(_) => None,
        }
    }

    /// The instance id, or the remote upstream's name.
    pub fn name(&self) -> &str {
        match &self.to {
            To::Local(l) => l.label.as_ref().map_or(&l.instance.id, |x| &x.0),
            To::Remote(r) => &r.endpoint.name,
        }
    }

    /// [`Leg::name`] as the `x-tokengate-instance` header value.
    pub fn id_header(&self) -> HeaderValue {
        match &self.to {
            To::Local(l) => l
                .label
                .as_ref()
                .map_or_else(|| l.instance.id_header.clone(), |x| x.1.clone()),
            To::Remote(r) => r.endpoint.id_header.clone(),
        }
    }
}

/// What the response of the current attempt has shown so far.
#[derive(Default)]
pub struct ResponseState {
    /// Request arrival → first token.
    pub ttft: Option<Duration>,
    pub first_token: bool,
    pub sse: Option<SseScanner>,
    pub json: Option<JsonCollector>,
    /// The engine's served model name renamed back to the client's in the answer.
    pub rename: Option<crate::rename::Rename>,
    pub usage: Usage,
    pub upstream_status: Option<u16>,
    /// The current attempt received a response header.
    pub answered: bool,
    /// The current attempt ended with this retryable engine status (see
    /// `dispatch::on_response_header`); the next attempt releases it.
    pub retry_status: Option<u16>,
    /// The upstream's answer reached its end.
    pub ended: bool,
    /// When the last chunk of the answer arrived, and the longest gap between two chunks
    /// (about an engine step: [`linger`]).
    pub last_chunk: Option<Instant>,
    pub max_gap: Option<Duration>,
}

/// Per-request context (Pingora's CTX).
pub struct Ctx {
    pub start: Instant,
    pub request_id: String,
    /// `request_id` as a header value, built once for the upstream request and the response.
    pub request_id_header: Option<HeaderValue>,
    pub api: Option<Api>,
    pub plan: Option<Plan>,
    /// The planned upstream body (the client's bytes, or the plan's rewrite).
    pub body: Option<Bytes>,
    /// The current attempt's legs (the main leg first).
    pub legs: Vec<Leg>,
    /// The attempts so far: how many, what was tried, where the next one goes.
    pub attempt: tries::State,
    /// A disaggregated service: the current attempt's pair and its prefill's progress.
    pub pd: Option<pd::side::Attempt>,
    /// The reason of the last dispatched main leg (kept for the access log after it ends).
    pub reason: Cow<'static, str>,
    pub response: ResponseState,
    /// Main request whose body went to a subrequest ([`crate::bigbody`]); the subrequest
    /// accounts for it.
    pub delegated: bool,
    /// Status of a response the gateway wrote itself.
    pub local_status: Option<u16>,
    pub local_error: Option<String>,
    pub deadline_hit: bool,
    /// A planned request refused before it had legs (throttling), whose plan is not kept.
    /// (Boxed: every request's state carries the field, few requests a value.)
    pub refused: Option<Box<Refused>>,
    /// The current attempt's upstream socket, held until the engine lets go ([`linger`]).
    pub upstream: Option<linger::Held>,
    /// Features following the request from its plan to its end ([`crate::hook`]: the
    /// traffic mirror's log line).
    pub followers: Vec<Box<dyn crate::hook::Follower>>,
    /// The tenant of the client's key ([`crate::tenants`]); `None`: no tenants configured.
    pub tenant: Option<TenantState>,
    /// The request's spans (`tracing:` configured, [`crate::otel`]); `None`: not traced.
    pub trace: Option<crate::otel::Trace>,
}

impl Ctx {
    pub fn new() -> Ctx {
        Ctx {
            start: Instant::now(),
            request_id: String::new(),
            request_id_header: None,
            api: None,
            plan: None,
            body: None,
            legs: Vec::new(),
            attempt: tries::State::default(),
            pd: None,
            reason: Cow::Borrowed(""),
            response: ResponseState::default(),
            delegated: false,
            local_status: None,
            local_error: None,
            deadline_hit: false,
            refused: None,
            upstream: None,
            followers: Vec::new(),
            tenant: None,
            trace: None,
        }
    }

    /// The tenant of the client's key.
    pub fn tenant(&self) -> Option<&crate::tenants::Tenant> {
        self.tenant.as_ref().map(|t| &*t.tenant)
    }

    /// The body the current attempt sends.
    pub fn upstream_body(&self) -> Option<&Bytes> {
        self.attempt.sent.as_ref().or(self.body.as_ref())
    }

    /// The main leg of the current attempt.
    pub fn main_leg(&self) -> Option<&Leg> {
        self.legs.iter().find(|l| l.role == LegRole::Main)
    }

    pub fn main_leg_mut(&mut self) -> Option<&mut Leg> {
        self.legs.iter_mut().find(|l| l.role == LegRole::Main)
    }

    /// The instance (or remote upstream) of the current attempt, `-` before one is chosen.
    pub fn instance_id(&self) -> &str {
        self.main_leg().map_or("-", |l| l.name())
    }

    pub fn anthropic(&self) -> bool {
        self.api.is_some_and(Api::is_anthropic)
    }

    /// Sets the request id: the client's `x-request-id` when sane, else a fresh one.
    pub fn set_request_id(&mut self, from_client: Option<&str>) {
        self.request_id = match from_client {
            Some(id) if !id.is_empty() && id.len() <= 200 => id.to_string(),
            _ => new_request_id(),
        };
        self.request_id_header = HeaderValue::from_str(&self.request_id).ok();
    }
}

/// A request's tenant: who, and the limit that refused the request.
pub struct TenantState {
    pub tenant: Arc<crate::tenants::Tenant>,
    /// A `tokengate_tenant_rejections_total` reason.
    pub refused: Option<&'static str>,
}

impl TenantState {
    pub fn new(tenant: Arc<crate::tenants::Tenant>) -> TenantState {
        TenantState {
            tenant,
            refused: None,
        }
    }
}

/// A planned request refused admission before it had legs: no throttling slot (or no
/// member gateway could take it), or the client left while queued for one.
pub struct Refused {
    /// The model label (the plan's destination) for the metrics and the access line.
    pub model: String,
    /// The client left while queued for a throttling slot.
    pub left_queue: bool,
}

impl Default for Ctx {
    fn default() -> Self {
        Ctx::new()
    }
}

/// What a subrequest (bodies above 64 KiB) inherits from the main request that admitted
/// and planned it.
pub struct Handoff {
    pub plan: Plan,
    pub body: Bytes,
    /// The planned legs (with their load guards).
    pub legs: Vec<Leg>,
    /// The client's `Content-Type` (the subrequest session drops body headers; the body
    /// itself comes from `body` on every attempt, see [`crate::bigbody`]).
    pub content_type: Option<HeaderValue>,
    /// The request's followers (told by the subrequest how it ended).
    pub followers: Vec<Box<dyn crate::hook::Follower>>,
    /// The request's spans.
    pub trace: Option<crate::otel::Trace>,
}

/// A fresh request id: 32 hex digits, a random per-process prefix and a counter (unique,
/// unguessable across restarts, and no system call per request).
fn new_request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let p = *PREFIX.get_or_init(|| uuid::Uuid::new_v4().as_u64_pair().0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Hex by hand: `format!` cost more than the rest of the id (hot path).
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = String::with_capacity(32);
    for v in [p, n] {
        for shift in (0..16).rev() {
            id.push(HEX[((v >> (shift * 4)) & 0xf) as usize] as char);
        }
    }
    id
}

/// Writes a complete local response.
pub async fn respond(
    session: &mut Session,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    request_id: &str,
) -> Result<()> {
    respond_with(session, status, content_type, body, request_id, None, None).await
}

/// Writes a complete local response; with the tenant's `x-ratelimit-*` headers when it
/// has per-minute limits.
pub async fn respond_with(
    session: &mut Session,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    request_id: &str,
    retry_after: Option<Duration>,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<()> {
    let mut h = ResponseHeader::build(status, Some(5))?;
    if let Some(r) = retry_after {
        let secs = r.as_secs() + u64::from(r.subsec_nanos() > 0);
        h.insert_header("retry-after", secs.max(1).to_string())?;
    }
    if let Some(t) = tenant {
        let mut r = Ok(());
        crate::tenants::headers(t, None, |k, v| {
            if r.is_ok() {
                r = h.insert_header(k, v);
            }
        });
        r?;
    }
    h.insert_header("content-type", content_type)?;
    h.insert_header("content-length", body.len().to_string())?;
    if !request_id.is_empty() {
        h.insert_header("x-request-id", request_id)?;
    }
    if status == 405 {
        h.insert_header("allow", "POST")?;
    }
    session.write_response_header(Box::new(h), false).await?;
    session
        .write_response_body(Some(Bytes::from(body)), true)
        .await?;
    Ok(())
}

/// Answers with a gateway error in the client's API shape and records it in the context.
pub async fn reject(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    e: crate::error::GatewayError,
) -> Result<bool> {
    reject_after(session, ctx, status, e, None).await
}

/// [`reject`] with a `Retry-After` header (seconds, rounded up).
pub async fn reject_after(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    e: crate::error::GatewayError,
    retry_after: Option<Duration>,
) -> Result<bool> {
    ctx.local_status = Some(status);
    ctx.local_error = Some(e.to_string());
    // A request whose body we did not read cannot leave the connection reusable.
    if !session.is_body_done() {
        session.set_keepalive(None);
    }
    respond_with(
        session,
        status,
        "application/json",
        e.body(ctx.anthropic()),
        &ctx.request_id,
        retry_after,
        ctx.tenant(),
    )
    .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Ctx` lives inline in Pingora's per-request future, which is written whole each time
    /// a request begins (bench/results/reliability.md, memory per stream): a field that
    /// grows it much belongs in a `Box` of its own (1,008 bytes when this was written; 1,088
    /// with each feature's fields grouped).
    #[test]
    fn ctx_stays_small() {
        let size = std::mem::size_of::<Ctx>();
        assert!(size <= 1152, "Ctx is {size} bytes");
    }
}
