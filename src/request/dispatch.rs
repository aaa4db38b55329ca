//! Phase 3, **dispatch**: each leg to its engine, and its response observed as it streams.
//!
//! * [`peer`] (`upstream_peer`): on a retry [`attempt::retry`] completes the failed attempt
//!   and picks the next leg(s) (without the instances already tried); the leg is then
//!   dispatched (the scheduler learns it — a session binds —, the prompt goes into the
//!   service's prefix index, the decision is counted and, at debug level, explained) and its
//!   `HttpPeer` built.
//! * [`upstream_request`] / [`request_body`]: headers fixed for the engine, our copy of the
//!   body sent whole on every attempt.
//! * [`retry_on_status`], [`error_while_proxy`], [`fail_to_connect`]: an attempt that failed
//!   before any response byte reached the client (a refused or reset connection, a
//!   retryable status such as 503/429, a timeout) goes on where [`attempt::after_failure`]
//!   says: another instance, the next split-proxy entry or member gateway.
//! * [`response_header`] / [`response_body`]: the routing headers; the **first token** (the
//!   first SSE event carrying output, or the end of a non-stream body) ends the leg's prefill
//!   phase and gives the TTFT; the usage is read from the JSON body or the SSE events.

use super::attempt::{self, gw_err, Failure, Next};
use super::{global, pd, Ctx, LegRole, Plan, To};
use crate::api;
use crate::clock::now_ms;
use crate::error::GatewayError;
use crate::shared::Shared;
use crate::usage::{JsonCollector, SseScanner};
use bytes::Bytes;
use http::HeaderValue;
use log::{debug, warn};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::ErrorType;
use std::time::{Duration, Instant};
use tokengate_plugins::RequestView;

/// The error an attempt ends with when the engine answered a retryable status.
const RETRY_STATUS: ErrorType = ErrorType::Custom("engine answered a retryable status");

/// Records where the request goes after the current attempt failed with `f` (see
/// [`attempt`]), or `None`: the failure is the answer.
fn next_after(ctx: &mut Ctx, f: Failure) -> Option<Next> {
    let next = attempt::after_failure(ctx, ctx.plan.as_ref()?, f)?;
    ctx.attempt.next = Some(next);
    if let Some(t) = ctx.trace.as_mut() {
        let (error, status) = match f {
            Failure::Status(s) => ("http_status", Some(s)),
            Failure::Connect => ("connect_error", None),
            Failure::Reset => ("connection_reset", None),
            Failure::Timeout => ("timeout", None),
            Failure::Prefill => ("prefill_failed", None),
            Failure::Other => ("upstream_error", None),
        };
        t.attempt_failed(error, status, next != Next::Local);
    }
    Some(next)
}

/// How the log says where a failed attempt's request goes.
fn going(next: Next) -> &'static str {
    match next {
        Next::Local => "retrying on another instance",
        Next::Entry => "failing over to the next split.proxies entry",
        Next::Member => "trying the next member gateway",
    }
}

/// `upstream_peer`: dispatches the main leg (picking it again on a retry) and returns its
/// peer.
pub async fn peer(shared: &Shared, session: &Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
    // The plan is taken out for the attempt (no copy) and put back below.
    let Some(plan) = ctx.plan.take() else {
        return Err(Error::explain(ErrorType::InternalError, "no plan"));
    };
    let r = dispatch_main(shared, session, ctx, &plan).await;
    ctx.plan = Some(plan);
    r
}

async fn dispatch_main(
    shared: &Shared,
    session: &Session,
    ctx: &mut Ctx,
    plan: &Plan,
) -> Result<Box<HttpPeer>> {
    let headers = &session.req_header().headers;
    if ctx.main_leg().is_some_and(|l| l.dispatched.is_some()) {
        // A retry: the previous attempt failed before answering; where the request goes
        // next was decided when it failed.
        attempt::retry(shared, headers, ctx, plan).await?;
    }
    loop {
        let peer = dispatch_legs(shared, ctx, plan)?;
        if ctx.legs.iter().any(|l| l.role == LegRole::Prefill) {
            // A disaggregated service: the prefill side first (vLLM: all of it).
            if let Err(f) = pd::dispatch(shared, session, ctx, plan).await {
                attempt::prefill_failed(shared, headers, ctx, plan, f).await?;
                continue;
            }
        }
        return Ok(peer);
    }
}

/// Dispatches the attempt's legs: each is counted and explained, the scheduler and the
/// prefix index learn the instance that computes the prompt (the prefill instance of a
/// disaggregated service), and the main leg's peer is built.
fn dispatch_legs(shared: &Shared, ctx: &mut Ctx, plan: &Plan) -> Result<Box<HttpPeer>> {
    ctx.attempt.count += 1;
    // This attempt's body: the planned one unless a leg rewrites it (below, and a
    // disaggregated pair's prefill fields in [`pd::dispatch`]).
    ctx.attempt.sent = None;
    let now = now_ms();
    let at = Instant::now();
    let mut peer = None;
    for leg in ctx.legs.iter_mut() {
        if leg.role == LegRole::Main {
            leg.dispatched = Some(at);
            leg.dispatched_ms = now;
            shared
                .metrics
                .decisions
                .with_label_values(&[leg.metric_reason()])
                .inc();
            if let Some(x) = &leg.explain {
                debug!(
                    "route {} model={} dest={} {}",
                    plan.request_id,
                    plan.info.model,
                    plan.dest.name(),
                    x
                );
            }
            ctx.reason = leg.reason.clone();
        }
        match &leg.to {
            To::Local(l) => {
                if l.instance.role != tokengate_plugins::Role::Decode {
                    // The scheduler and the prefix index learn the dispatch.
                    if let Some(s) = l.by.scheduler() {
                        let view = RequestView {
                            session: l.session,
                            blocks: &plan.blocks,
                            now_ms: now,
                            ..RequestView::default()
                        };
                        s.pipeline.on_dispatch(&view, &l.cand);
                    }
                    l.service.index.insert(&plan.blocks, l.instance.key, now);
                    plan.runtime.cost.dispatched(l.instance.key, now);
                    let prompt = plan.info.prompt_tokens_est;
                    plan.runtime
                        .cost
                        .routed(prompt, prompt.saturating_sub(l.uncached_tokens));
                    super::cluster::dispatched(shared, plan, l);
                    l.instance
                        .bound_index(&l.service.index, plan.runtime.block_tokens);
                }
                if leg.role != LegRole::Main {
                    continue;
                }
                // The engine serves the service's `model` (else its name): rewrite `model`
                // when the client named an alias, a route or fell back to the default model.
                if l.service.served != plan.info.model {
                    ctx.attempt.sent = ctx
                        .body
                        .as_ref()
                        .and_then(|b| api::rewrite_model(b, &l.service.served))
                        .map(Bytes::from);
                }
                if l.service.pd.is_none() {
                    ctx.attempt.tried.push(l.instance.key);
                }
                peer = Some(match &l.instance.tls {
                    Some(t) => t.peer(l.instance.addr),
                    None => HttpPeer::new(l.instance.addr, false, String::new()),
                });
            }
            To::Remote(r) => {
                let e = r.endpoint.clone();
                ctx.attempt.tried_remote.push(e.name.clone());
                let Some(addr) = e.addr() else {
                    warn!(
                        "request {}: {} ({}) does not resolve",
                        plan.request_id,
                        e.name,
                        e.origin()
                    );
                    return Err(gw_err(GatewayError::Unavailable(format!(
                        "{} does not resolve",
                        e.name
                    ))));
                };
                if let (Some(_), Some(m)) = (&r.entry, &r.model) {
                    // An external API: its own model name.
                    ctx.attempt.sent = ctx
                        .body
                        .as_ref()
                        .and_then(|b| api::rewrite_model(b, m))
                        .map(Bytes::from);
                }
                peer = Some(e.peer(addr));
            }
        }
    }
    let Some(mut peer) = peer else {
        return Err(Error::explain(ErrorType::InternalError, "no leg"));
    };
    // An unsampled request has no attempt span: nothing of it is formatted.
    if let Some(t) = ctx.trace.as_mut().filter(|t| t.recording()) {
        use pingora::upstreams::peer::Peer as _;
        let main = ctx.legs.iter().find(|l| l.role == LegRole::Main);
        t.attempt_start(&crate::otel::AttemptInfo {
            instance: main.map_or("-", |l| l.name()),
            address: Some(peer.address().to_string()),
            reason: main.map_or("", |l| l.reason.as_ref()),
            predicted_tokens: main
                .and_then(|l| l.local())
                .map(|l| u64::from(l.prefix.matched) * plan.runtime.block_tokens as u64),
        });
    }
    let t = &plan.runtime.timeouts;
    peer.options.connection_timeout = Some(t.connect);
    peer.options.total_connection_timeout = Some(t.connect);
    peer.options.read_timeout = Some(t.first_byte.max(t.idle));
    peer.options.write_timeout = Some(t.idle);
    peer.options.idle_timeout = Some(Duration::from_secs(60));
    Ok(Box::new(peer))
}

/// `fail_to_connect`: retry on another instance (or the next entry, member) when one is
/// left.
pub fn fail_to_connect(ctx: &mut Ctx, mut e: Box<Error>) -> Box<Error> {
    if let Some(next) = next_after(ctx, Failure::Connect) {
        warn!(
            "request {}: connect to {} failed ({e}); {}",
            ctx.request_id,
            ctx.instance_id(),
            going(next)
        );
        e.set_retry(true);
    }
    e
}

/// `upstream_response_filter`: an engine answered a retryable status
/// (`passive_health.retry_on_status`) before any response byte reached the client: end this
/// attempt with a retryable error, so that Pingora calls `upstream_peer` again (another
/// instance) and replays the body through `request_body_filter`. Nothing has been written
/// downstream yet: Pingora runs the response filters on a batch of upstream tasks before
/// writing any of them. With no attempt or instance left, the engine's answer is passed
/// through.
///
/// A disaggregated pair: when the decode answered an error, the prefill's outcome is
/// awaited briefly ([`pd::settle_after_decode_error`]); a failed prefill makes the attempt
/// retryable (a fresh room on a new pair) whatever the decode answered, or, with no retry
/// left or a bad request, the prefill's error is the answer.
pub async fn retry_on_status(resp: &ResponseHeader, ctx: &mut Ctx) -> Result<()> {
    let status = resp.status.as_u16();
    if ctx.pd.is_some() {
        pd::settle_after_decode_error(ctx, status).await;
        let failed = ctx
            .pd
            .as_ref()
            .and_then(|a| a.side.failure().map(|f| (f, a.prefill.id.clone())));
        if let Some((f, prefill)) = failed {
            let next = (ctx.local_status.is_none() && f.retryable())
                .then(|| next_after(ctx, Failure::Prefill))
                .flatten();
            if let Some(next) = next {
                warn!(
                    "request {}: prefill instance {prefill} failed ({}); {}",
                    ctx.request_id,
                    f.message,
                    match next {
                        Next::Local => "retrying with a new pair",
                        n => going(n),
                    }
                );
                ctx.response.retry_status = Some(status);
                let mut e =
                    Error::explain(RETRY_STATUS, format!("prefill instance {prefill} failed"));
                e.set_retry(true);
                return Err(e.into_up());
            }
            return Err(gw_err(f.gateway_error(&prefill, &ctx.request_id)));
        }
    }
    if ctx.local_status.is_none() {
        if let Some(next) = next_after(ctx, Failure::Status(status)) {
            warn!(
                "request {}: instance {} answered {status}; {}",
                ctx.request_id,
                ctx.instance_id(),
                going(next)
            );
            ctx.response.retry_status = Some(status);
            let mut e = Error::explain(
                RETRY_STATUS,
                format!("instance {} answered {status}", ctx.instance_id()),
            );
            e.set_retry(true);
            return Err(e.into_up());
        }
    }
    ctx.response.answered = true;
    Ok(())
}

/// `error_while_proxy`: Pingora's default never retries a POST once connected. Here an
/// attempt that failed before any byte reached the client goes on where [`attempt`] says:
/// the engine answered a retryable status ([`retry_on_status`]), its connection was closed
/// or reset before it answered anything (an engine refusing work, a stale pooled
/// connection), or (not retried on our own instances: it would multiply the wait) it timed
/// out; the body is replayed from our own copy, whatever its size. Anything else: Pingora's
/// default.
pub fn error_while_proxy(
    peer: &HttpPeer,
    session: &mut Session,
    e: Box<Error>,
    ctx: &mut Ctx,
    client_reused: bool,
) -> Box<Error> {
    // A gateway error (its context is the client's message) stays as it is.
    let mut e = if matches!(e.etype(), ErrorType::HTTPStatus(_)) {
        e
    } else {
        e.more_context(format!("Peer: {peer}"))
    };
    if ctx.response.retry_status.is_some() && e.etype() == &RETRY_STATUS {
        e.set_retry(true);
        return e;
    }
    ctx.response.retry_status = None;
    let before_answer = !ctx.response.answered && session.response_written().is_none();
    let upstream = e.esource() == &pingora::ErrorSource::Upstream;
    let failure = match e.etype() {
        ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError if upstream => {
            Failure::Reset
        }
        ErrorType::ReadTimedout | ErrorType::WriteTimedout if upstream => Failure::Timeout,
        _ => Failure::Other,
    };
    match before_answer.then(|| next_after(ctx, failure)).flatten() {
        Some(next) => {
            warn!(
                "request {}: {} failed before answering ({e}); {}",
                ctx.request_id,
                ctx.instance_id(),
                going(next)
            );
            e.set_retry(true);
        }
        None => {
            if !session.req_header().method.is_idempotent()
                || session.as_ref().retry_buffer_truncated()
            {
                e.set_retry(false);
            } else {
                e.retry.decide_reuse(client_reused);
            }
        }
    }
    e
}

/// `upstream_request_filter`: headers for the engine.
pub fn upstream_request(up: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
    let len = ctx.upstream_body().map_or(0, Bytes::len);
    up.remove_header("transfer-encoding");
    up.remove_header("expect");
    up.insert_header(http::header::CONTENT_LENGTH, HeaderValue::from(len))?;
    // The gateway parses the response: no compression.
    up.remove_header("accept-encoding");
    if let Some(id) = ctx.request_id_header.clone() {
        up.insert_header("x-request-id", id)?;
    }
    if let Some(t) = ctx.trace.as_ref() {
        // The client's own trace headers are replaced by the gateway's span context (an
        // insert replaces a header of the same name; a client's tracestate goes when the
        // gateway's context has none).
        if up.headers.contains_key(&crate::otel::TRACESTATE) {
            up.remove_header(&crate::otel::TRACESTATE);
        }
        for (name, value) in t.outgoing() {
            up.insert_header(name, value)?;
        }
    }
    if let Some(plan) = ctx.plan.as_ref() {
        let local = ctx.main_leg().and_then(|l| l.local());
        if let Some(auth) = local.and_then(|l| l.instance.auth.clone()) {
            // The engine's own key replaces whatever the client sent.
            up.remove_header("x-api-key");
            up.insert_header("authorization", auth)?;
        } else if !plan.forward_auth {
            // The client's key is the gateway's, not the engine's (names parsed once).
            up.remove_header(&http::header::AUTHORIZATION);
            up.remove_header(&super::admit::X_API_KEY);
        }
        if let Some(l) = local {
            up.insert_header("host", l.instance.host_header.clone())?;
        }
        if let Some(r) = ctx.main_leg().and_then(|l| l.remote()) {
            let e = &r.endpoint;
            match &r.entry {
                Some(entry) => {
                    // An external API: its key replaces the client's (Anthropic requests
                    // carry it as x-api-key), the client's path after /v1 goes under its
                    // base URL.
                    if entry.bearer.is_some() {
                        up.remove_header("authorization");
                        up.remove_header("x-api-key");
                        if matches!(plan.api, api::Api::Messages) {
                            if let Some(k) = entry.x_api_key.clone() {
                                up.insert_header("x-api-key", k)?;
                            }
                        } else if let Some(a) = entry.bearer.clone() {
                            up.insert_header("authorization", a)?;
                        }
                    }
                    let path = up.uri.path_and_query().map_or("/", |p| p.as_str());
                    let rest = path.strip_prefix("/v1").unwrap_or(path);
                    let uri = format!("{}{rest}", e.base_path);
                    match uri.parse::<http::Uri>() {
                        Ok(u) => up.set_uri(u),
                        Err(err) => {
                            return Err(Error::explain(
                                ErrorType::InternalError,
                                format!("upstream path {uri:?}: {err}"),
                            ))
                        }
                    }
                }
                None => {
                    // Another gateway: its own key, the hop mark.
                    up.remove_header("authorization");
                    up.remove_header("x-api-key");
                    if let Some(a) = r.auth.clone() {
                        up.insert_header("authorization", a)?;
                    }
                    up.insert_header(global::HOP_HEADER, plan.runtime.hop_name.clone())?;
                }
            }
            up.insert_header("host", e.host_header())?;
        }
    }
    Ok(())
}

/// `request_body_filter`: the client's body was read while admitting; send our copy, whole,
/// once per attempt.
pub fn request_body(body: &mut Option<Bytes>, end_of_stream: bool, ctx: &Ctx) {
    if end_of_stream {
        *body = ctx.upstream_body().filter(|b| !b.is_empty()).cloned();
    } else {
        *body = None;
    }
}

/// `response_filter`: the engine's response header arrived (the prefill phase goes on until
/// the first token); adds the routing headers.
pub fn response_header(resp: &mut ResponseHeader, ctx: &mut Ctx) -> Result<()> {
    if ctx.local_status.is_some() {
        return Ok(());
    }
    ctx.response.upstream_status = Some(resp.status.as_u16());
    let is_sse = resp
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let strip = ctx.plan.as_ref().is_some_and(|r| r.strip_usage);
    if is_sse {
        ctx.response.sse = Some(SseScanner::new(strip));
        if strip {
            resp.remove_header("content-length");
        }
    } else {
        ctx.response.json = Some(JsonCollector::default());
    }
    // The engine names its served model: the client gets back the name it sent (a route or
    // the default model: the service's name).
    ctx.response.rename = match (ctx.main_leg().and_then(|l| l.local()), &ctx.plan) {
        (Some(l), Some(plan)) => {
            crate::rename::Rename::new(&l.service.served, l.service.reply_name(&plan.info.model))
        }
        _ => None,
    };
    if ctx.response.rename.is_some() {
        // The body's length changes.
        resp.remove_header("content-length");
        if resp.headers.get("transfer-encoding").is_none() {
            resp.insert_header("transfer-encoding", "chunked")?;
        }
    }
    let shown = ctx.plan.as_ref().map(|p| &p.runtime.response_headers);
    if let Some(shown) = shown {
        // The engine's own x-* headers reach the client only when configured.
        let hidden: Vec<http::HeaderName> = resp
            .headers
            .keys()
            .filter(|n| !shown.passes(n.as_str()))
            .cloned()
            .collect();
        for n in &hidden {
            resp.remove_header(n);
        }
    }
    let routing = shown.is_none_or(|s| s.routing);
    if let (true, Some(l)) = (routing, ctx.main_leg()) {
        resp.insert_header("x-tokengate-instance", l.id_header())?;
    }
    if let Some(t) = ctx.tenant() {
        let mut r = Ok(());
        let ticket = ctx.plan.as_ref().and_then(|p| p.ticket.as_ref());
        crate::tenants::headers(t, ticket, |k, v| {
            if r.is_ok() {
                r = resp.insert_header(k, v);
            }
        });
        r?;
    }
    if routing && !ctx.reason.is_empty() {
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
    // Held at the gateway for its saturated instance (`engine_queue`): for how long.
    let held = ctx
        .main_leg()
        .and_then(|l| l.local())
        .and_then(|l| l.sent.as_ref())
        .map_or(Duration::ZERO, |s| s.held);
    if routing && !held.is_zero() {
        resp.insert_header("x-tokengate-held-ms", held.as_millis().to_string())?;
    }
    if let Some(id) = ctx.request_id_header.clone() {
        resp.insert_header("x-request-id", id)?;
    }
    Ok(())
}

/// Marks the first token: the leg leaves its prefill phase, the TTFT is taken.
fn first_token(ctx: &mut Ctx) {
    if std::mem::replace(&mut ctx.response.first_token, true) {
        return;
    }
    let ttft = ctx.start.elapsed();
    ctx.response.ttft = Some(ttft);
    if let Some(t) = ctx.trace.as_mut() {
        t.first_token(ttft);
    }
    if let Some(l) = ctx.main_leg_mut().and_then(|l| l.local_mut()) {
        l.guard.first_token();
        // The fleet-wide prefill slot goes back with the local one.
        l.leases.retain(|x| !x.prefill);
        // The engine's queue is one shorter: the next held request goes.
        if let Some(s) = l.sent.as_mut() {
            s.release();
        }
    }
}

/// `response_body_filter`: first token, usage, the total deadline.
pub fn response_body(
    body: &mut Option<Bytes>,
    end_of_stream: bool,
    ctx: &mut Ctx,
) -> Result<Option<Duration>> {
    if ctx.local_status.is_some() {
        return Ok(None);
    }
    if !ctx.response.first_token {
        // A disaggregated pair whose prefill failed after the decode answered: its KV will
        // not come.
        if let Some(a) = ctx.pd.as_ref() {
            if let Some(f) = a.side.failure() {
                return Err(gw_err(f.gateway_error(&a.prefill.id, &ctx.request_id)));
            }
        }
    }
    if (ctx.body.is_some() || ctx.attempt.sent.is_some())
        && body.as_ref().is_some_and(|b| !b.is_empty())
    {
        // The answer has begun: no attempt follows, so the body kept to replay on another
        // instance goes (a long prompt would otherwise stay for the stream's whole life).
        ctx.body = None;
        ctx.attempt.sent = None;
    }
    if body.as_ref().is_some_and(|b| !b.is_empty()) && ctx.upstream.is_some() {
        // The gaps between chunks: about one engine step ([`super::linger`]).
        let now = Instant::now();
        if let Some(prev) = ctx.response.last_chunk.replace(now) {
            let gap = now.saturating_duration_since(prev);
            if ctx.response.max_gap.is_none_or(|g| gap > g) {
                ctx.response.max_gap = Some(gap);
            }
        }
    }
    if end_of_stream {
        ctx.response.ended = true;
        // The tenant's in-flight slot is free before the client can see the answer's end.
        if let Some(t) = ctx.plan.as_mut().and_then(|p| p.ticket.as_mut()) {
            t.release_slot();
        }
    }
    if let Some(b) = body.as_ref() {
        if let Some(sse) = ctx.response.sse.as_mut() {
            if let Some(replaced) = sse.feed(b) {
                *body = Some(replaced);
            }
            if sse.first_token {
                first_token(ctx);
            }
        } else if let Some(j) = ctx.response.json.as_mut() {
            j.feed(b);
        }
    }
    if end_of_stream {
        if let Some(sse) = ctx.response.sse.as_mut() {
            if let Some(rest) = sse.finish() {
                if !rest.is_empty() {
                    let mut v = body.take().map(|b| b.to_vec()).unwrap_or_default();
                    v.extend_from_slice(&rest);
                    *body = Some(Bytes::from(v));
                }
            }
            ctx.response.usage = sse.usage;
        } else {
            if let Some(j) = ctx.response.json.as_mut() {
                ctx.response.usage = j.finish().unwrap_or_default();
            }
            // A non-stream body holds every token: the whole of it is the first token.
            first_token(ctx);
        }
    } else if let Some(plan) = ctx.plan.as_ref() {
        if ctx.start.elapsed() > plan.runtime.timeouts.total {
            ctx.deadline_hit = true;
            return Err(Error::explain(
                ErrorType::HTTPStatus(504),
                "request exceeded timeouts.total",
            ));
        }
    }
    if let Some(r) = ctx.response.rename.as_mut() {
        if let Some(renamed) = body.as_deref().and_then(|b| r.feed(b)) {
            *body = Some(renamed);
        }
        if end_of_stream {
            if let Some(rest) = r.finish() {
                let mut v = body.take().map(|b| b.to_vec()).unwrap_or_default();
                v.extend_from_slice(&rest);
                *body = Some(Bytes::from(v));
            }
        }
    }
    Ok(None)
}
