//! The Pingora proxy: one [`Gateway`] implementing `ProxyHttp`, and the per-request [`Ctx`].
//!
//! Flow of one request (see DESIGN.md "One request, end to end"):
//! 1. `request_filter`: local endpoints, auth, `Expect: 100-continue`, read the whole body
//!    (bounded), parse it into a [`RequestInfo`], resolve the service, prepare the upstream
//!    body (byte-exact, or rewritten). Bodies that fit Pingora's 64 KiB retry buffer take the
//!    plain path; larger ones are handed to a subrequest ([`crate::bigbody`]) that runs this
//!    same pipeline with the body fed from memory.
//! 2. `upstream_peer`: candidates minus instances already tried → load balancing → an RAII
//!    [`LoadGuard`] → `HttpPeer`.
//! 3. `upstream_request_filter` / `request_body_filter`: fix headers, send our copy of the body.
//! 4. Response filters: routing headers, first byte, TTFT, usage from JSON or SSE.
//! 5. `logging`: outcome into the load table, metrics, one access-log line.

use crate::api::{self, Api, RequestInfo};
use crate::bigbody;
use crate::error::GatewayError;
use crate::load::{LoadGuard, Outcome};
use crate::metrics::Metrics;
use crate::schedule::{self, Chosen, Inputs};
use crate::state::{Dest, Instance, Runtime};
use crate::usage::{JsonCollector, SseScanner, Usage};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use http::HeaderValue;
use log::{debug, info, warn};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::ErrorType;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest body Pingora can replay from its retry buffer (`BODY_BUF_LIMIT` in pingora-core).
pub const RETRY_BUFFER_LIMIT: usize = 64 * 1024;
/// Attempts per request (first try + retries to other instances after a connect failure
/// or a retryable status, `passive_health.retry_on_status`).
const MAX_ATTEMPTS: usize = 3;
/// Largest request head (request line + headers) accepted; larger ones get 431. Engines
/// reject far smaller heads (uvicorn/h11: 64 KiB), so forwarding them is pointless.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// The error an attempt ends with when the engine answered a retryable status.
const RETRY_STATUS: ErrorType = Custom("engine answered a retryable status");

/// State shared by every request.
pub struct Shared {
    pub runtime: ArcSwap<Runtime>,
    pub metrics: Metrics,
    /// Client of the routes' decision services (pooled).
    pub decision: crate::decision::DecisionClient,
}

/// The proxy application.
pub struct Gateway {
    pub shared: Arc<Shared>,
}

/// What a subrequest inherits from the main request that read the body.
pub struct Handoff {
    pub plan: Plan,
    pub body: Bytes,
    /// The client's `Content-Type` (the subrequest session drops body headers; the body
    /// itself comes from `body` on every attempt, see [`crate::bigbody`]).
    pub content_type: Option<HeaderValue>,
}

/// A parsed, resolved request: everything needed to pick an instance and send the body.
#[derive(Clone)]
pub struct Plan {
    pub api: Api,
    pub info: Arc<RequestInfo>,
    /// The service or route the request's `model` resolved to.
    pub dest: Dest,
    /// The decision service's choice of target (routes with a decision-service plugin).
    pub decision: Option<u32>,
    pub runtime: Arc<Runtime>,
    pub start: Instant,
    pub request_id: String,
    /// The gateway added `stream_options.include_usage`; remove the usage chunk downstream.
    pub strip_usage: bool,
    /// Forward the client's Authorization / x-api-key headers (gateway auth disabled).
    pub forward_auth: bool,
}

/// Per-request context.
pub struct Ctx {
    start: Instant,
    request_id: String,
    /// `request_id` as a header value, built once for the upstream request and the response.
    request_id_header: Option<HeaderValue>,
    api: Option<Api>,
    plan: Option<Plan>,
    /// The body sent upstream (the client's bytes, or a rewrite).
    body: Option<Bytes>,
    /// Instances already tried.
    tried: Vec<tokengate_plugins::InstanceKey>,
    guard: Option<LoadGuard<Instance>>,
    reason: std::borrow::Cow<'static, str>,
    /// The current attempt's scheduling decision.
    chosen: Option<Chosen>,
    /// The prompt's block hashes (computed when a prefix-aware scheduler needs them).
    blocks: Option<Vec<u64>>,
    ttft: Option<Duration>,
    body_seen: bool,
    sse: Option<SseScanner>,
    json: Option<JsonCollector>,
    usage: Usage,
    upstream_status: Option<u16>,
    /// Main request whose body went to a subrequest; the subrequest accounts for it.
    delegated: bool,
    /// Status of a response the gateway wrote itself.
    local_status: Option<u16>,
    local_error: Option<String>,
    deadline_hit: bool,
    /// The current attempt ended with this retryable engine status (see
    /// `upstream_response_filter`); the next `upstream_peer` releases it.
    retry_status: Option<u16>,
    /// The current attempt received a response header.
    attempt_answered: bool,
}

impl Ctx {
    /// The instance of the current attempt, `-` before one is chosen.
    fn instance_id(&self) -> &str {
        self.chosen.as_ref().map_or("-", |c| c.instance.id.as_str())
    }

    fn anthropic(&self) -> bool {
        self.api.is_some_and(Api::is_anthropic)
    }
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

/// Constant-time comparison of a presented key with a configured one.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn header_str<'a>(req: &'a RequestHeader, name: &str) -> Option<&'a str> {
    req.headers.get(name).and_then(|v| v.to_str().ok())
}

/// The key a client presented: `Authorization: Bearer …` (OpenAI SDKs) or `x-api-key`
/// (Anthropic SDKs).
fn presented_key(req: &RequestHeader) -> Option<&[u8]> {
    if let Some(v) = req.headers.get("authorization") {
        let v = v.as_bytes();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
            return Some(v[7..].trim_ascii());
        }
    }
    req.headers
        .get("x-api-key")
        .map(|v| v.as_bytes().trim_ascii())
}

/// Writes a complete local response.
pub async fn respond(
    session: &mut Session,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    request_id: &str,
) -> Result<()> {
    let mut h = ResponseHeader::build(status, Some(4))?;
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

/// A Pingora error that `fail_to_proxy` turns into this gateway error.
fn gw_err(e: GatewayError) -> Box<Error> {
    Error::explain(HTTPStatus(e.status()), e.to_string())
}

impl Gateway {
    async fn reject(&self, session: &mut Session, ctx: &mut Ctx, e: GatewayError) -> Result<bool> {
        let status = e.status();
        self.reject_as(session, ctx, status, e).await
    }

    /// [`Self::reject`] with a status the error type has no variant for (431).
    async fn reject_as(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        status: u16,
        e: GatewayError,
    ) -> Result<bool> {
        ctx.local_status = Some(status);
        ctx.local_error = Some(e.to_string());
        // A request whose body we did not read cannot leave the connection reusable.
        if !session.is_body_done() {
            session.set_keepalive(None);
        }
        respond(
            session,
            status,
            "application/json",
            e.body(ctx.anthropic()),
            &ctx.request_id,
        )
        .await?;
        Ok(true)
    }

    /// Reads the whole request body, at most `max` bytes, within `timeout` (a slow-loris
    /// upload is a 408, not a connection held forever).
    async fn read_body(
        session: &mut Session,
        max: usize,
        timeout: Duration,
    ) -> Result<Result<Bytes, GatewayError>> {
        // Each read waits at most `timeout` too (Pingora's default per read is 60 s).
        session.downstream_session.set_read_timeout(Some(timeout));
        let deadline = tokio::time::Instant::now() + timeout;
        let mut parts: Vec<Bytes> = Vec::new();
        let mut len = 0usize;
        loop {
            let slow = || {
                Ok(Err(GatewayError::RequestTimeout(format!(
                    "request body not received within timeouts.client_body ({})",
                    humantime::format_duration(timeout)
                ))))
            };
            let chunk = match tokio::time::timeout_at(deadline, session.read_request_body()).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) if e.etype() == &ReadTimedout => return slow(),
                Ok(Err(e)) => return Err(e.into_down()),
                Err(_) => return slow(),
            };
            let Some(chunk) = chunk else { break };
            len += chunk.len();
            if len > max {
                return Ok(Err(GatewayError::PayloadTooLarge(format!(
                    "request body exceeds max_body_bytes ({max} bytes)"
                ))));
            }
            parts.push(chunk);
        }
        Ok(Ok(match parts.len() {
            0 => Bytes::new(),
            1 => parts.pop().expect("one part"),
            _ => {
                let mut v = Vec::with_capacity(len);
                for p in &parts {
                    v.extend_from_slice(p);
                }
                Bytes::from(v)
            }
        }))
    }

    /// The main request's part of `request_filter`. Returns Ok(true) when answered.
    async fn main_request(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let rt = self.shared.runtime.load_full();
        let req = session.req_header();
        let path = req.uri.path();
        let method = req.method.clone();
        let Some(api) = Api::from_path(path) else {
            return match (method.as_str(), path.trim_end_matches('/')) {
                ("GET", "/v1/models") => {
                    ctx.local_status = Some(200);
                    let body = serde_json::to_vec(&rt.models_json()).unwrap_or_default();
                    respond(session, 200, "application/json", body, &ctx.request_id).await?;
                    Ok(true)
                }
                ("GET", "/health") => {
                    ctx.local_status = Some(200);
                    respond(
                        session,
                        200,
                        "text/plain",
                        b"ok\n".to_vec(),
                        &ctx.request_id,
                    )
                    .await?;
                    Ok(true)
                }
                (_, "/v1/models") | (_, "/health") => {
                    let e = GatewayError::MethodNotAllowed(format!(
                        "method {method} is not allowed on {path}; use GET"
                    ));
                    self.reject(session, ctx, e).await
                }
                _ => {
                    let e = GatewayError::NotFound(format!(
                        "unknown path {path}; tokengate serves POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and GET /v1/models"
                    ));
                    self.reject(session, ctx, e).await
                }
            };
        };
        ctx.api = Some(api);
        let head_bytes = session.req_header().raw_path().len()
            + session
                .req_header()
                .headers
                .iter()
                .map(|(k, v)| k.as_str().len() + v.len() + 4)
                .sum::<usize>();
        if head_bytes > MAX_HEADER_BYTES {
            let e = GatewayError::BadRequest(format!(
                "request headers too large ({head_bytes} bytes; at most {MAX_HEADER_BYTES})"
            ));
            return self.reject_as(session, ctx, 431, e).await;
        }
        if method != http::Method::POST {
            let e = GatewayError::MethodNotAllowed(format!(
                "method {method} is not allowed on {path}; use POST"
            ));
            return self.reject(session, ctx, e).await;
        }
        // Auth before anything is read.
        if !rt.api_keys.is_empty() {
            let ok = presented_key(session.req_header())
                .is_some_and(|k| rt.api_keys.iter().any(|c| ct_eq(k, c)));
            if !ok {
                let msg = if presented_key(session.req_header()).is_some() {
                    "invalid API key"
                } else {
                    "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
                };
                return self
                    .reject(session, ctx, GatewayError::Unauthorized(msg.into()))
                    .await;
            }
        }
        let max = rt.max_body_bytes;
        if let Some(cl) = header_str(session.req_header(), "content-length") {
            if cl.trim().parse::<usize>().is_ok_and(|n| n > max) {
                let e = GatewayError::PayloadTooLarge(format!(
                    "request body of {cl} bytes exceeds max_body_bytes ({max} bytes)"
                ));
                return self.reject(session, ctx, e).await;
            }
        }
        if header_str(session.req_header(), "expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
        {
            session.req_header_mut().remove_header("expect");
            session
                .downstream_session
                .write_continue_response()
                .await
                .map_err(|e| e.into_down())?;
        }
        session.enable_retry_buffering();
        let body = match Self::read_body(session, max, rt.timeouts.client_body).await? {
            Ok(b) => b,
            Err(e) => return self.reject(session, ctx, e).await,
        };
        let info = match api::parse_request(api, &body) {
            Ok(i) => i,
            Err(e) => return self.reject(session, ctx, e).await,
        };
        let Some(dest) = rt.resolve(&info.model) else {
            let e = GatewayError::ModelNotFound(format!(
                "model {:?} is not served here; GET /v1/models lists the models",
                info.model
            ));
            return self.reject(session, ctx, e).await;
        };
        // The upstream body: the client's bytes unless a feature must rewrite them (the
        // model is rewritten per attempt, in upstream_peer, when a route or the default
        // model sends the request to a service of another name).
        let mut upstream_body = body;
        let mut strip_usage = false;
        if info.stream && api.has_stream_options() && !info.client_wants_usage {
            let injected = if info.has_stream_options {
                set_include_usage(&upstream_body)
            } else {
                api::inject_include_usage(&upstream_body)
            };
            if let Some(b) = injected {
                upstream_body = Bytes::from(b);
                strip_usage = true;
            }
        }
        let forward_auth = rt.api_keys.is_empty();
        let decision = self.ask_decision_service(&dest, &info).await;
        let plan = Plan {
            api,
            info: Arc::new(info),
            dest,
            decision,
            runtime: rt,
            start: ctx.start,
            request_id: ctx.request_id.clone(),
            strip_usage,
            forward_auth,
        };
        if session.as_ref().retry_buffer_truncated() {
            // Pingora cannot replay this body from its retry buffer: run the proxy pipeline
            // as a subrequest that is fed the body from memory.
            ctx.delegated = true;
            let content_type = session.req_header().headers.get("content-type").cloned();
            bigbody::run(
                session,
                Handoff {
                    plan,
                    body: upstream_body,
                    content_type,
                },
            )
            .await?;
            return Ok(true);
        }
        ctx.plan = Some(plan);
        ctx.body = Some(upstream_body);
        Ok(false)
    }

    /// Asks the route's decision service which target fits (routes with one configured).
    /// Never fails the request: a timeout, an error or an answer naming no target abstains.
    async fn ask_decision_service(&self, dest: &Dest, info: &RequestInfo) -> Option<u32> {
        let Dest::Route(r) = dest else { return None };
        let (provider, spec) = r.decision.as_ref()?;
        let text = crate::decision::request_text(&info.prompt);
        let (outcome, latency) = self.shared.decision.decide(provider, spec, text).await;
        let m = &self.shared.metrics;
        m.decision_total
            .with_label_values(&[r.name.as_str(), outcome.label()])
            .inc();
        m.decision_latency
            .with_label_values(&[r.name.as_str()])
            .observe(latency.as_secs_f64());
        debug!(
            "decision service {} for route {}: {outcome} in {:.1} ms",
            provider.name,
            r.name,
            latency.as_secs_f64() * 1e3
        );
        outcome.target().map(|t| t as u32)
    }
}

/// Whether another attempt is allowed: attempts left and an untried available instance.
fn can_retry(ctx: &Ctx) -> bool {
    let Some(plan) = ctx.plan.as_ref() else {
        return false;
    };
    let more = match &plan.dest {
        Dest::Service(s) => s.has_untried(&ctx.tried),
        Dest::Route(r) => r.targets.iter().any(|s| s.has_untried(&ctx.tried)),
    };
    more && ctx.tried.len() < MAX_ATTEMPTS
}

/// Feeds a request's outcome to the instance's passive health.
fn passive_failure(inst: &Arc<Instance>, failed: bool, rt: &Runtime) {
    let p = &rt.passive;
    let eject_ms = p.eject_for.as_millis() as u64;
    if inst
        .health
        .on_request(failed, p.max_failures, eject_ms, crate::state::now_ms())
    {
        warn!(
            "instance {} ejected for {:?} after {} consecutive failed requests",
            inst.id, p.eject_for, p.max_failures
        );
    }
}

/// Whether the instance is to blame: an upstream-side error, or a 5xx it answered.
fn upstream_failed(e: Option<&Error>, upstream_status: Option<u16>) -> bool {
    e.is_some_and(|e| e.esource() == &ErrorSource::Upstream)
        || upstream_status.is_some_and(|s| s >= 500)
}

/// Sets `stream_options.include_usage: true` in a body that already has `stream_options`.
fn set_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let so = v
        .as_object_mut()?
        .get_mut("stream_options")?
        .as_object_mut()?;
    so.insert("include_usage".into(), serde_json::Value::Bool(true));
    serde_json::to_vec(&v).ok()
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            start: Instant::now(),
            request_id: String::new(),
            request_id_header: None,
            api: None,
            plan: None,
            body: None,
            tried: Vec::new(),
            guard: None,
            reason: std::borrow::Cow::Borrowed(""),
            chosen: None,
            blocks: None,
            ttft: None,
            body_seen: false,
            sse: None,
            json: None,
            usage: Usage::default(),
            upstream_status: None,
            delegated: false,
            local_status: None,
            local_error: None,
            deadline_hit: false,
            retry_status: None,
            attempt_answered: false,
        }
    }

    fn allow_spawning_subrequest(&self, session: &Session, _ctx: &Ctx) -> bool {
        session.subrequest_ctx.is_none()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        // A subrequest carries the main request's parsed route and body.
        if let Some(sub) = session.subrequest_ctx.as_mut() {
            let handoff = sub
                .user_ctx_mut()
                .and_then(|u| u.downcast_mut::<Option<Handoff>>())
                .and_then(Option::take);
            let Some(h) = handoff else {
                return Err(Error::explain(
                    InternalError,
                    "subrequest without a handoff",
                ));
            };
            if let Some(ct) = h.content_type {
                session.req_header_mut().insert_header("content-type", ct)?;
            }
            ctx.start = h.plan.start;
            ctx.request_id = h.plan.request_id.clone();
            ctx.request_id_header = HeaderValue::from_str(&ctx.request_id).ok();
            ctx.api = Some(h.plan.api);
            ctx.plan = Some(h.plan);
            ctx.body = Some(h.body);
            return Ok(false);
        }
        ctx.request_id = match header_str(session.req_header(), "x-request-id") {
            Some(id) if !id.is_empty() && id.len() <= 200 => id.to_string(),
            _ => new_request_id(),
        };
        ctx.request_id_header = HeaderValue::from_str(&ctx.request_id).ok();
        self.main_request(session, ctx).await
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let Some(plan) = ctx.plan.clone() else {
            return Err(Error::explain(InternalError, "no plan"));
        };
        // A retry: the previous attempt failed to connect, or its engine answered a
        // retryable status. 5xx and connect failures count against the instance's passive
        // health; a 429 (busy, not broken) does not: ejecting busy engines under overload
        // would turn a slowdown into an outage.
        let retried = ctx.retry_status.take();
        ctx.attempt_answered = false;
        if let Some(g) = ctx.guard.take() {
            if retried.is_none_or(|s| s >= 500) {
                passive_failure(g.instance(), true, &plan.runtime);
            }
            g.finish(Outcome::Failed);
        }
        if ctx.tried.len() >= MAX_ATTEMPTS {
            return Err(gw_err(GatewayError::BadGateway(format!(
                "{} attempts to reach an instance of {:?} failed",
                ctx.tried.len(),
                plan.dest.name()
            ))));
        }
        let mut inputs = Inputs {
            headers: &session.req_header().headers,
            info: &plan.info,
            api: plan.api,
            blocks: &mut ctx.blocks,
            block_bytes: plan.runtime.block_bytes,
            decision: plan.decision,
        };
        let chosen = schedule::choose(&plan.dest, &mut inputs, &ctx.tried).map_err(gw_err)?;
        let inst = chosen.instance.clone();
        if let Some(x) = &chosen.explain {
            debug!(
                "route {} model={} dest={} {}",
                ctx.request_id,
                plan.info.model,
                plan.dest.name(),
                x
            );
        }
        self.shared
            .metrics
            .decisions
            .with_label_values(&[chosen.metric_reason()])
            .inc();
        // The engine serves the service's name: rewrite `model` when the client named a
        // route or fell back to the default model.
        if chosen.service.name != plan.info.model {
            if let Some(b) = ctx
                .body
                .as_ref()
                .and_then(|b| api::rewrite_model(b, &chosen.service.name))
            {
                ctx.body = Some(Bytes::from(b));
            }
        }
        ctx.reason = chosen.reason.clone();
        ctx.tried.push(inst.key);
        ctx.guard = Some(LoadGuard::acquire(
            inst.clone(),
            plan.info.expected_tokens(),
        ));
        ctx.chosen = Some(chosen);
        let t = &plan.runtime.timeouts;
        let mut peer = HttpPeer::new(inst.addr, false, String::new());
        peer.options.connection_timeout = Some(t.connect);
        peer.options.total_connection_timeout = Some(t.connect);
        peer.options.read_timeout = Some(t.first_byte.max(t.idle));
        peer.options.write_timeout = Some(t.idle);
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        Ok(Box::new(peer))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if can_retry(ctx) {
            warn!(
                "request {}: connect to {} failed ({e}); retrying on another instance",
                ctx.request_id,
                ctx.instance_id()
            );
            e.set_retry(true);
        }
        e
    }

    /// An engine answered a retryable status (`passive_health.retry_on_status`) before any
    /// response byte reached the client: end this attempt with a retryable error, so that
    /// Pingora calls `upstream_peer` again (another instance) and replays the body through
    /// `request_body_filter`. Nothing has been written downstream yet: Pingora runs the
    /// response filters on a batch of upstream tasks before writing any of them. With no
    /// attempt or instance left, the engine's answer is passed through.
    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let status = resp.status.as_u16();
        let retryable = ctx
            .plan
            .as_ref()
            .is_some_and(|p| p.runtime.passive.retry_on_status.contains(&status));
        if retryable && ctx.local_status.is_none() && can_retry(ctx) {
            warn!(
                "request {}: instance {} answered {status}; retrying on another instance",
                ctx.request_id,
                ctx.instance_id()
            );
            ctx.retry_status = Some(status);
            let mut e = Error::explain(
                RETRY_STATUS,
                format!("instance {} answered {status}", ctx.instance_id()),
            );
            e.set_retry(true);
            return Err(e.into_up());
        }
        ctx.attempt_answered = true;
        Ok(())
    }

    /// Pingora's default never retries a POST once connected. Here an attempt is retried
    /// on another instance when the engine answered a retryable status (decided in
    /// `upstream_response_filter`), or when its connection was closed or reset before it
    /// answered anything (an engine refusing work, a stale pooled connection): nothing reached
    /// the client and the body is replayed from our own copy, whatever its size. Timeouts
    /// are not retried (they would multiply the wait). Anything else: Pingora's default.
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        let reset_before_answer = !ctx.attempt_answered
            && e.esource() == &ErrorSource::Upstream
            && matches!(e.etype(), ConnectionClosed | ReadError | WriteError)
            && session.response_written().is_none();
        if ctx.retry_status.is_some() && e.etype() == &RETRY_STATUS {
            e.set_retry(true);
        } else if reset_before_answer && can_retry(ctx) {
            warn!(
                "request {}: instance {} closed the connection before answering ({e}); retrying on another instance",
                ctx.request_id,
                ctx.instance_id()
            );
            ctx.retry_status = None;
            e.set_retry(true);
        } else {
            ctx.retry_status = None;
            if !session.req_header().method.is_idempotent()
                || session.as_ref().retry_buffer_truncated()
            {
                e.set_retry(false);
            } else {
                e.retry.decide_reuse(client_reused);
            }
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        up: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let len = ctx.body.as_ref().map_or(0, Bytes::len);
        up.remove_header("transfer-encoding");
        up.remove_header("expect");
        up.insert_header(http::header::CONTENT_LENGTH, HeaderValue::from(len))?;
        // The gateway parses the response: no compression.
        up.remove_header("accept-encoding");
        if let Some(id) = ctx.request_id_header.clone() {
            up.insert_header("x-request-id", id)?;
        }
        if let Some(plan) = ctx.plan.as_ref() {
            if !plan.forward_auth {
                // The client's key is the gateway's, not the engine's.
                up.remove_header("authorization");
                up.remove_header("x-api-key");
            }
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // The client's body was read in request_filter; send our copy, whole, once.
        if end_of_stream {
            *body = ctx.body.clone().filter(|b| !b.is_empty());
        } else {
            *body = None;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if ctx.local_status.is_some() {
            return Ok(());
        }
        if let Some(g) = ctx.guard.as_mut() {
            g.first_byte();
        }
        ctx.upstream_status = Some(resp.status.as_u16());
        let is_sse = resp
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let strip = ctx.plan.as_ref().is_some_and(|r| r.strip_usage);
        if is_sse {
            ctx.sse = Some(SseScanner::new(strip));
            if strip {
                resp.remove_header("content-length");
            }
        } else {
            ctx.json = Some(JsonCollector::default());
        }
        if let Some(c) = ctx.chosen.as_ref() {
            resp.insert_header("x-tokengate-instance", c.instance.id_header.clone())?;
        }
        if !ctx.reason.is_empty() {
            // Static reasons are shared, not copied.
            let reason = match &ctx.reason {
                std::borrow::Cow::Borrowed(r) => {
                    HeaderValue::from_maybe_shared(Bytes::from_static(r.as_bytes()))
                }
                std::borrow::Cow::Owned(r) => HeaderValue::from_str(r),
            };
            if let Ok(r) = reason {
                resp.insert_header("x-tokengate-reason", r)?;
            }
        }
        if let Some(id) = ctx.request_id_header.clone() {
            resp.insert_header("x-request-id", id)?;
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        if ctx.local_status.is_some() {
            return Ok(None);
        }
        if let Some(b) = body.as_ref() {
            if !b.is_empty() && !ctx.body_seen {
                ctx.body_seen = true;
                ctx.ttft = Some(ctx.start.elapsed());
            }
            if let Some(sse) = ctx.sse.as_mut() {
                if let Some(replaced) = sse.feed(b) {
                    *body = Some(replaced);
                }
            } else if let Some(j) = ctx.json.as_mut() {
                j.feed(b);
            }
        }
        if end_of_stream {
            if let Some(sse) = ctx.sse.as_mut() {
                if let Some(rest) = sse.finish() {
                    if !rest.is_empty() {
                        let mut v = body.take().map(|b| b.to_vec()).unwrap_or_default();
                        v.extend_from_slice(&rest);
                        *body = Some(Bytes::from(v));
                    }
                }
                ctx.usage = sse.usage;
            } else if let Some(j) = ctx.json.as_mut() {
                ctx.usage = j.finish().unwrap_or_default();
            }
        } else if let Some(plan) = ctx.plan.as_ref() {
            if ctx.start.elapsed() > plan.runtime.timeouts.total {
                ctx.deadline_hit = true;
                return Err(Error::explain(
                    HTTPStatus(504),
                    "request exceeded timeouts.total",
                ));
            }
        }
        Ok(None)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let msg = e.context.as_ref().map(|c| c.as_str().to_string());
        let up = ctx.instance_id();
        let ge = match e.etype() {
            HTTPStatus(503) => {
                GatewayError::Unavailable(msg.unwrap_or_else(|| "no instance available".into()))
            }
            HTTPStatus(504) => {
                GatewayError::GatewayTimeout(msg.unwrap_or_else(|| "upstream timed out".into()))
            }
            HTTPStatus(502) => {
                GatewayError::BadGateway(msg.unwrap_or_else(|| "upstream failed".into()))
            }
            HTTPStatus(c) if *c >= 400 && *c < 500 => {
                GatewayError::BadRequest(msg.unwrap_or_else(|| "bad request".into()))
            }
            ConnectTimedout | ReadTimedout | WriteTimedout => {
                GatewayError::GatewayTimeout(format!("instance {up} timed out ({e})"))
            }
            ConnectRefused | ConnectNoRoute | ConnectError => {
                GatewayError::BadGateway(format!("cannot connect to instance {up} ({e})"))
            }
            _ => match e.esource() {
                ErrorSource::Downstream => {
                    // The client is gone or sent garbage; nothing useful to answer.
                    return FailToProxy {
                        error_code: 0,
                        can_reuse_downstream: false,
                    };
                }
                _ => GatewayError::BadGateway(format!("instance {up} failed: {e}")),
            },
        };
        let code = ge.status();
        ctx.local_error = Some(ge.to_string());
        // Only when nothing was sent yet can we answer with a clean error.
        let headers_sent = session.response_written().is_some();
        if !headers_sent {
            ctx.local_status = Some(code);
            // Say `Connection: close`: this connection is not reused after a proxy failure.
            session.set_keepalive(None);
            let _ = respond(
                session,
                code,
                "application/json",
                ge.body(ctx.anthropic()),
                &ctx.request_id,
            )
            .await;
        }
        FailToProxy {
            error_code: if headers_sent { 0 } else { code },
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        if ctx.delegated {
            return; // the subrequest that carried this request logged it
        }
        let status = ctx
            .local_status
            .or_else(|| session.response_written().map(|r| r.status.as_u16()))
            .unwrap_or(0);
        let client_left = e.is_some_and(|e| e.esource() == &ErrorSource::Downstream);
        let outcome = if ctx.deadline_hit || upstream_failed(e, ctx.upstream_status) {
            Outcome::Failed
        } else if client_left {
            Outcome::Cancelled
        } else if e.is_some() || status == 0 {
            Outcome::Failed
        } else {
            Outcome::Completed
        };
        if let Some(g) = ctx.guard.take() {
            if let Some(plan) = ctx.plan.as_ref() {
                match outcome {
                    Outcome::Failed => passive_failure(g.instance(), true, &plan.runtime),
                    Outcome::Completed => passive_failure(g.instance(), false, &plan.runtime),
                    Outcome::Cancelled => {}
                }
            }
            g.finish(outcome);
        }
        let m = &self.shared.metrics;
        if let Some(c) = ctx.chosen.as_ref() {
            if outcome == Outcome::Completed {
                schedule::on_complete(c, ctx.blocks.as_deref());
            }
            if let Some(p) = c.prefix {
                let bt = ctx.plan.as_ref().map_or(0, |p| p.runtime.block_tokens) as u64;
                m.prefix_tokens
                    .with_label_values(&["prompt"])
                    .inc_by(u64::from(p.prompt_blocks) * bt);
                m.prefix_tokens
                    .with_label_values(&["ceiling"])
                    .inc_by(u64::from(p.best) * bt);
                m.prefix_tokens
                    .with_label_values(&["predicted"])
                    .inc_by(u64::from(p.matched) * bt);
                if let (Some(prompt), Some(cached)) = (ctx.usage.prompt, ctx.usage.cached) {
                    m.engine_tokens
                        .with_label_values(&["prompt"])
                        .inc_by(prompt);
                    m.engine_tokens
                        .with_label_values(&["cached"])
                        .inc_by(cached);
                }
            }
        }
        let model = ctx
            .chosen
            .as_ref()
            .map(|c| c.service.name.as_str())
            .or(ctx.plan.as_ref().map(|p| p.dest.name()))
            .unwrap_or("-");
        let instance = ctx.instance_id();
        let code = status.to_string();
        m.requests
            .with_label_values(&[model, instance, code.as_str()])
            .inc();
        let dur = ctx.start.elapsed();
        if ctx.plan.is_some() {
            m.duration
                .with_label_values(&[model])
                .observe(dur.as_secs_f64());
        }
        let stream = ctx.plan.as_ref().is_some_and(|r| r.info.stream);
        if let (true, Some(t)) = (stream, ctx.ttft) {
            m.ttft.with_label_values(&[model]).observe(t.as_secs_f64());
        }
        let u = ctx.usage;
        if let Some(p) = u.prompt {
            m.tokens_prompt.inc_by(p);
        }
        if let Some(c) = u.completion {
            m.tokens_completion.inc_by(c);
        }
        if let Some(c) = u.cached {
            m.tokens_cached.inc_by(c);
        }
        // Nothing of the access line is formatted when its target is off.
        if log::log_enabled!(target: "access", log::Level::Info) {
            let req = session.req_header();
            let err = match (e, ctx.local_error.as_deref()) {
                (_, Some(m)) => format!(" error={m:?}"),
                (Some(e), None) => format!(" error={:?}", e.to_string()),
                _ => String::new(),
            };
            info!(
                target: "access",
                "{} {} {} model={} instance={} status={} ttft_ms={} dur_ms={:.1} prompt_tokens={} completion_tokens={} cached_tokens={} reason={} id={}{}",
                req.method,
                req.uri.path(),
                if stream { "stream" } else { "unary" },
                ctx.plan.as_ref().map_or("-", |r| r.info.model.as_str()),
                instance,
                status,
                ctx.ttft.map_or("-".to_string(), |t| format!("{:.1}", t.as_secs_f64() * 1e3)),
                dur.as_secs_f64() * 1e3,
                u.prompt.map_or("-".into(), |v| v.to_string()),
                u.completion.map_or("-".into(), |v| v.to_string()),
                u.cached.map_or("-".into(), |v| v.to_string()),
                if ctx.reason.is_empty() { "-" } else { ctx.reason.as_ref() },
                ctx.request_id,
                err,
            );
        }
    }
}
