//! The Pingora proxy: one [`Gateway`] implementing `ProxyHttp`. Each hook hands its work to
//! a phase of the request lifecycle ([`crate::request`]): `request_filter` admits and plans,
//! `upstream_peer` … `response_body_filter` dispatch, `logging` completes. Bodies that fit
//! Pingora's 64 KiB retry buffer are proxied by this request; larger ones by a subrequest
//! ([`crate::bigbody`]) that runs these same hooks with the body fed from memory. Once a
//! request is planned, a sampled copy may be queued for the traffic mirror ([`crate::mirror`]).

use crate::bigbody;
use crate::error::GatewayError;
use crate::request::{
    self, admit, attempt, complete, dispatch, global, plan, Ctx, Handoff, Refused, TenantState,
};
use crate::shared::Shared;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::ErrorType;
use std::sync::Arc;
use std::time::Duration;

/// Largest body Pingora can replay from its retry buffer (`BODY_BUF_LIMIT` in pingora-core).
pub const RETRY_BUFFER_LIMIT: usize = 64 * 1024;

/// The proxy application.
pub struct Gateway {
    pub shared: Arc<Shared>,
}

impl Gateway {
    /// The features that follow a planned request to its end ([`crate::hook`]). The traffic
    /// mirror: a sampled copy of the request, queued for the background sender (nothing
    /// here waits for it), and the mirror log line's primary half.
    fn on_planned(
        &self,
        req: &RequestHeader,
        plan: &request::Plan,
        body: &Bytes,
        followers: &mut Vec<Box<dyn crate::hook::Follower>>,
    ) {
        if let Some(m) = plan.runtime.mirror.as_ref() {
            let ticket = self
                .shared
                .mirror
                .offer(m, req, body, &plan.request_id, &plan.info.model);
            if let Some(t) = ticket {
                followers.push(Box::new(t));
            }
        }
    }

    /// The main request: admit, plan, then proxy here or hand over to a subrequest.
    async fn main_request(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let rt = self.shared.runtime.load_full();
        let Some(admitted) = admit::admit(session, ctx, rt, self.shared.cluster.as_ref()).await?
        else {
            return Ok(true);
        };
        if let Some(o) = self.shared.otel.load().as_ref() {
            let req = session.req_header();
            ctx.trace = Some(o.start(&req.headers, ctx.start, req.uri.path()));
        }
        // Forwarded by another region's gateway: never forwarded again.
        let hop = session
            .req_header()
            .headers
            .contains_key(global::HOP_HEADER);
        let planned = plan::plan(&self.shared, admitted, ctx.start, &ctx.request_id, hop).await;
        let (plan, body) = match planned {
            Ok(p) => p,
            Err(e) => return request::reject(session, ctx, e.status(), e).await,
        };
        let followers = ctx.followers.len();
        self.on_planned(session.req_header(), &plan, &body, &mut ctx.followers);
        if let Some(t) = ctx.trace.as_mut() {
            let (operation, provider) = crate::genai_metrics::operation_of(plan.api);
            t.planned(crate::otel::Planned {
                operation,
                provider,
                model: &plan.info.model,
                max_tokens: plan.info.max_tokens,
                stream: plan.info.stream,
                dest: plan.dest.name(),
                tenant: ctx.tenant.as_ref().map(|t| t.tenant.name.as_str()),
            });
            if ctx.followers.len() > followers {
                t.event("mirrored", Vec::new());
            }
            if let Some(d) = plan.decision_call.as_ref() {
                t.decision(d.started, d.latency, d.outcome, &d.model, plan.dest.name());
            }
        }
        let queued = ctx
            .trace
            .as_ref()
            .is_some_and(|t| t.recording())
            .then(std::time::Instant::now);
        // Admission to an instance: a throttling slot (reject, or wait in the queue); what
        // this region cannot take may go to another region's gateway, or, with the split
        // proxy's local entry set to fail over, to an external API ([`request::attempt`]).
        let admitted = attempt::admit(&self.shared, session, &plan).await;
        if let (Some(t), Some(q)) = (ctx.trace.as_mut(), queued) {
            let denied = match &admitted {
                Ok(Err(d)) => Some(d.status),
                _ => None,
            };
            t.admitted(q.elapsed(), denied);
        }
        let legs = match admitted {
            Ok(Ok(legs)) => legs,
            Ok(Err(d)) => {
                ctx.refused = Some(Box::new(Refused {
                    model: plan.dest.name().to_string(),
                    left_queue: false,
                }));
                return request::reject_after(session, ctx, d.status, d.error, d.retry_after).await;
            }
            Err(e) => {
                // The client hung up while queued for a slot.
                ctx.refused = Some(Box::new(Refused {
                    model: plan.dest.name().to_string(),
                    left_queue: true,
                }));
                return Err(e);
            }
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
                    body,
                    legs,
                    content_type,
                    followers: std::mem::take(&mut ctx.followers),
                    trace: ctx.trace.take(),
                },
            )
            .await?;
            return Ok(true);
        }
        ctx.plan = Some(plan);
        ctx.body = Some(body);
        ctx.legs = legs;
        Ok(false)
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    fn allow_spawning_subrequest(&self, session: &Session, _ctx: &Ctx) -> bool {
        session.subrequest_ctx.is_none()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        // A subrequest carries the main request's plan, legs and body.
        if let Some(sub) = session.subrequest_ctx.as_mut() {
            let handoff = sub
                .user_ctx_mut()
                .and_then(|u| u.downcast_mut::<Option<Handoff>>())
                .and_then(Option::take);
            let Some(h) = handoff else {
                return Err(Error::explain(
                    ErrorType::InternalError,
                    "subrequest without a handoff",
                ));
            };
            if let Some(ct) = h.content_type {
                session.req_header_mut().insert_header("content-type", ct)?;
            }
            ctx.start = h.plan.start;
            let id = h.plan.request_id.clone();
            ctx.set_request_id(Some(&id));
            ctx.api = Some(h.plan.api);
            ctx.followers = h.followers;
            ctx.trace = h.trace;
            ctx.tenant = h
                .plan
                .ticket
                .as_ref()
                .map(|t| TenantState::new(t.tenant.clone()));
            ctx.plan = Some(h.plan);
            ctx.body = Some(h.body);
            ctx.legs = h.legs;
            return Ok(false);
        }
        // Requests pipelined behind this one (sent before its answer) are answered after
        // it, in order, on the same connection (RFC 9112 §9.3.2), not dropped with it.
        session.downstream_session.set_pipelining_enabled(true);
        let id = session
            .req_header()
            .headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        ctx.set_request_id(id.as_deref());
        self.main_request(session, ctx).await
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        dispatch::peer(&self.shared, session, ctx).await
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        e: Box<Error>,
    ) -> Box<Error> {
        dispatch::fail_to_connect(ctx, e)
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        dispatch::retry_on_status(resp, ctx).await
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        dispatch::error_while_proxy(peer, session, e, ctx, client_reused)
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        _reused: bool,
        _peer: &HttpPeer,
        fd: std::os::unix::io::RawFd,
        _digest: Option<&pingora::protocols::Digest>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // A throttled service's request keeps its slot until the engine lets go of the
        // connection ([`request::linger`]).
        let throttled = ctx
            .main_leg()
            .and_then(|l| l.local())
            .is_some_and(|l| l.service.throttle.is_some());
        ctx.upstream = if throttled {
            request::linger::Held::of(fd)
        } else {
            None
        };
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        up: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        dispatch::upstream_request(up, ctx)
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        dispatch::request_body(body, end_of_stream, ctx);
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        dispatch::response_header(resp, ctx)?;
        if session.req_header().version == http::Version::HTTP_10
            && resp.headers.get(http::header::CONTENT_LENGTH).is_none()
        {
            // HTTP/1.0 has no chunked encoding (Pingora adds it to a body of unknown length,
            // a stream): the body is delimited by closing the connection instead.
            resp.remove_header(&http::header::TRANSFER_ENCODING);
            resp.insert_header(http::header::CONNECTION, "close")?;
            session.set_keepalive(None);
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
        dispatch::response_body(body, end_of_stream, ctx)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let Some(ge) = client_error(e, ctx) else {
            // The client is gone or sent garbage; nothing useful to answer.
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        };
        let code = ge.status();
        // The client's body says what failed; the detail (addresses, OS errors) is for the
        // log: the access line's `error=` and this warning, both with the request id.
        let detail = match e.etype() {
            ErrorType::HTTPStatus(_) => ge.to_string(),
            _ => e.to_string(),
        };
        if !matches!(e.etype(), ErrorType::HTTPStatus(_)) {
            log::warn!(
                "request {}: answered {code}: {} failed: {detail}",
                ctx.request_id,
                ctx.instance_id()
            );
        }
        ctx.local_error = Some(detail);
        // Only when nothing was sent yet can we answer with a clean error.
        let headers_sent = session.response_written().is_some();
        if !headers_sent {
            ctx.local_status = Some(code);
            // Say `Connection: close`: this connection is not reused after a proxy failure.
            session.set_keepalive(None);
            let _ = request::respond_with(
                session,
                code,
                "application/json",
                ge.body(ctx.anthropic()),
                &ctx.request_id,
                None,
                ctx.tenant(),
            )
            .await;
        }
        FailToProxy {
            error_code: if headers_sent { 0 } else { code },
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        complete::finish(&self.shared, session, e, ctx);
    }
}

/// The error a failed proxy attempt answers the client with, `None` when the client is gone.
/// The gateway's own errors (`HTTPStatus`, their message written for clients) pass as they
/// are; an upstream failure says what failed — connecting, a timeout, the answer breaking
/// off — and names the instance only when the routing headers name it too
/// (`response_headers.routing`), never its address or the OS error.
fn client_error(e: &Error, ctx: &Ctx) -> Option<GatewayError> {
    let msg = e.context.as_ref().map(|c| c.as_str().to_string());
    let routing = ctx
        .plan
        .as_ref()
        .is_none_or(|p| p.runtime.response_headers.routing);
    let who = match (routing, ctx.main_leg()) {
        (true, Some(l)) => format!("instance {}", l.name()),
        _ => "the upstream".to_string(),
    };
    let see = format!(
        " (request id {}: details in the gateway's log)",
        ctx.request_id
    );
    Some(match e.etype() {
        ErrorType::HTTPStatus(503) => {
            GatewayError::Unavailable(msg.unwrap_or_else(|| "no instance available".into()))
        }
        ErrorType::HTTPStatus(504) => {
            GatewayError::GatewayTimeout(msg.unwrap_or_else(|| "upstream timed out".into()))
        }
        ErrorType::HTTPStatus(502) => {
            GatewayError::BadGateway(msg.unwrap_or_else(|| "upstream failed".into()))
        }
        ErrorType::HTTPStatus(c) if *c >= 400 && *c < 500 => {
            GatewayError::BadRequest(msg.unwrap_or_else(|| "bad request".into()))
        }
        ErrorType::ConnectTimedout => {
            GatewayError::GatewayTimeout(format!("connecting to {who} timed out{see}"))
        }
        ErrorType::ReadTimedout | ErrorType::WriteTimedout => {
            GatewayError::GatewayTimeout(format!("{who} did not answer in time{see}"))
        }
        ErrorType::ConnectRefused | ErrorType::ConnectNoRoute | ErrorType::ConnectError => {
            GatewayError::BadGateway(format!("cannot connect to {who}{see}"))
        }
        _ => match e.esource() {
            pingora::ErrorSource::Downstream => return None,
            _ => GatewayError::BadGateway(format!("{who} failed before answering{see}")),
        },
    })
}
