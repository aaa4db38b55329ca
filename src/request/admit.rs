//! Phase 1, **admit**: who may send what. Local endpoints are answered here; an inference
//! request passes the head-size limit, the method check and the API key, then its body is
//! read (at most `max_body_bytes`, within `timeouts.client_body`) and parsed into a
//! [`RequestInfo`]. The key names the request's tenant ([`crate::tenants`]): the model must
//! be one it may call (403 otherwise) and its limits must admit the request (429 with
//! `Retry-After` otherwise); the admitted request holds a [`Ticket`] until it completes.
//! Every refusal is an API-shaped error; nothing is sent upstream.

use super::{reject, reject_after, respond, Ctx, TenantState};
use crate::api::{self, Api, RequestInfo};
use crate::error::GatewayError;
use crate::runtime::Runtime;
use crate::tenants::{self, Tenant, Ticket};
use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::ErrorType;
use std::sync::Arc;
use std::time::Duration;

/// Largest request head (request line + headers) accepted; larger ones get 431. Engines
/// reject far smaller heads (uvicorn/h11: 64 KiB), so forwarding them is pointless.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// An admitted inference request.
pub struct Admitted {
    pub api: Api,
    pub runtime: Arc<Runtime>,
    pub body: Bytes,
    pub info: RequestInfo,
    /// Its tenant's hold on the limits (a gateway with keys).
    pub ticket: Option<Ticket>,
    /// Its session's fleet binding, read along with the tenant's fleet-wide admission.
    pub fleet_session: Option<Box<FleetSession>>,
}

pub use crate::tenants::ct_eq;

fn header_str<'a>(req: &'a RequestHeader, name: &str) -> Option<&'a str> {
    req.headers.get(name).and_then(|v| v.to_str().ok())
}

/// Anthropic's key header, parsed once.
pub const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// The key a client presented: `Authorization: Bearer …` (OpenAI SDKs) or `x-api-key`
/// (Anthropic SDKs).
fn presented_key(req: &RequestHeader) -> Option<&[u8]> {
    if let Some(v) = req.headers.get(http::header::AUTHORIZATION) {
        let v = v.as_bytes();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
            return Some(v[7..].trim_ascii());
        }
    }
    req.headers
        .get(X_API_KEY)
        .map(|v| v.as_bytes().trim_ascii())
}

/// The API key check (when `api_keys` or `tenants` are set): the key's tenant.
fn authorize(req: &RequestHeader, rt: &Runtime) -> Result<Option<Arc<Tenant>>, GatewayError> {
    if rt.tenants.is_empty() {
        return Ok(None);
    }
    let presented = presented_key(req);
    if let Some(t) = presented.and_then(|k| rt.tenants.by_key(k)) {
        return Ok(Some(t.clone()));
    }
    let msg = if presented.is_some() {
        "invalid API key"
    } else {
        "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
    };
    Err(GatewayError::Unauthorized(msg.into()))
}

/// The body is JSON: a `Content-Type` that says so (`application/json`,
/// `application/*+json`, any parameters), or none. Anything else is a 415: a browser's
/// cross-site form (`text/plain`, `application/x-www-form-urlencoded`,
/// `multipart/form-data`) posts without a CORS preflight, so a JSON API that took it would
/// answer any web page its visitors open.
fn json_content_type(req: &RequestHeader) -> Result<(), GatewayError> {
    let Some(v) = req.headers.get(http::header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = v
        .to_str()
        .ok()
        .and_then(|s| s.split(';').next())
        .map(|s| s.trim().to_ascii_lowercase());
    let json = essence.as_deref().is_some_and(|m| {
        m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
    });
    if json {
        return Ok(());
    }
    Err(GatewayError::UnsupportedMediaType(format!(
        "Content-Type {:?} is not JSON; send the body as application/json",
        String::from_utf8_lossy(v.as_bytes())
    )))
}

/// Admits the request or answers it. `Ok(None)`: answered (a local endpoint or a refusal).
pub async fn admit(
    session: &mut Session,
    ctx: &mut Ctx,
    rt: Arc<Runtime>,
    cluster: Option<&Arc<crate::cluster::Cluster>>,
) -> Result<Option<Admitted>> {
    let req = session.req_header();
    let path = req.uri.path();
    let method = req.method.clone();
    let Some(api) = Api::from_path(path) else {
        local_endpoint(session, ctx, &rt).await?;
        return Ok(None);
    };
    ctx.api = Some(api);
    let head_bytes = req.raw_path().len()
        + req
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if head_bytes > MAX_HEADER_BYTES {
        let e = GatewayError::BadRequest(format!(
            "request headers too large ({head_bytes} bytes; at most {MAX_HEADER_BYTES})"
        ));
        reject(session, ctx, 431, e).await?;
        return Ok(None);
    }
    if method != http::Method::POST {
        let e = GatewayError::MethodNotAllowed(format!(
            "method {method} is not allowed on {path}; use POST"
        ));
        reject(session, ctx, e.status(), e).await?;
        return Ok(None);
    }
    // Auth before anything is read.
    match authorize(session.req_header(), &rt) {
        Ok(t) => ctx.tenant = t.map(TenantState::new),
        Err(e) => {
            reject(session, ctx, e.status(), e).await?;
            return Ok(None);
        }
    }
    if let Err(e) = json_content_type(session.req_header()) {
        reject(session, ctx, e.status(), e).await?;
        return Ok(None);
    }
    let max = rt.max_body_bytes;
    if let Some(cl) = header_str(session.req_header(), "content-length") {
        if cl.trim().parse::<usize>().is_ok_and(|n| n > max) {
            let e = GatewayError::PayloadTooLarge(format!(
                "request body of {cl} bytes exceeds max_body_bytes ({max} bytes)"
            ));
            reject(session, ctx, e.status(), e).await?;
            return Ok(None);
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
    let body = match read_body(session, max, rt.timeouts.client_body).await? {
        Ok(b) => b,
        Err(e) => {
            reject(session, ctx, e.status(), e).await?;
            return Ok(None);
        }
    };
    let info = match api::parse_request(api, &body) {
        Ok(i) => i,
        Err(e) => {
            reject(session, ctx, e.status(), e).await?;
            return Ok(None);
        }
    };
    let mut ticket = match ctx.tenant.as_ref().map(|t| t.tenant.clone()) {
        Some(t) => match tenant_gate(&t, &rt, &info) {
            Ok(ticket) => Some(ticket),
            Err((reason, e, retry_after)) => {
                if let Some(t) = ctx.tenant.as_mut() {
                    t.refused = Some(reason);
                }
                reject_after(session, ctx, e.status(), e, retry_after).await?;
                return Ok(None);
            }
        },
        None => None,
    };
    let mut fleet_session = None;
    if let (Some(c), Some(tk)) = (cluster, ticket.as_mut()) {
        // Boxed: the admission of every request does not carry this future's state.
        match Box::pin(fleet_gate(c, tk, &rt, session.req_header(), &info, api)).await {
            Ok(s) => fleet_session = s.map(Box::new),
            Err(r) => {
                let t = tk.tenant.clone();
                if let Some(tk) = ticket.take() {
                    tk.refund();
                }
                let (reason, e, retry_after) = over_limit(&t, r);
                if let Some(t) = ctx.tenant.as_mut() {
                    t.refused = Some(reason);
                }
                reject_after(session, ctx, e.status(), e, retry_after).await?;
                return Ok(None);
            }
        }
    }
    Ok(Some(Admitted {
        api,
        runtime: rt,
        body,
        info,
        ticket,
        fleet_session,
    }))
}

/// The tenant's fleet-wide limits (`cluster:`), after its local ones admitted the request:
/// one Redis round trip, which also reads the binding of the request's session (the read
/// the routing path would make; it is handed to it). `Ok`: admitted (or Redis away: the
/// local limits alone hold, per replica), with the session's binding when read.
async fn fleet_gate(
    c: &Arc<crate::cluster::Cluster>,
    ticket: &mut Ticket,
    rt: &Runtime,
    req: &RequestHeader,
    info: &RequestInfo,
    api: Api,
) -> Result<Option<FleetSession>, tenants::Refusal> {
    use crate::cluster::TenantAdmission;
    let Some(limits) = tenants::fleet_limits(&ticket.tenant.limits) else {
        return Ok(None);
    };
    let target = rt
        .resolve(&info.model)
        .and_then(|d| d.session_target(&req.headers, info, api));
    let key = target.as_ref().map(|(scope, s)| c.session_ref(scope, *s));
    let (input, output) = ticket.reserved();
    let name = ticket.tenant.name.clone();
    match c
        .admit_tenant(&name, limits, input, output, key.as_deref())
        .await
    {
        TenantAdmission::Admitted { hold, session } => {
            ticket.attach_fleet(hold);
            Ok(target.map(|(scope, s)| (scope, s, session)))
        }
        TenantAdmission::Refused { limit, retry_after } => Err(tenants::Refusal {
            over: match limit {
                1 => tenants::Over::Requests,
                2 => tenants::Over::InputTokens,
                3 => tenants::Over::OutputTokens,
                _ => tenants::Over::Concurrency,
            },
            retry_after,
        }),
        TenantAdmission::Unknown => Ok(None),
    }
}

/// A session's fleet binding read at admission: the table's name, the session, the id.
type FleetSession = (String, tokengate_plugins::SessionKey, Option<String>);

/// A limit's refusal as the reason, the error and the `Retry-After` of the answer.
fn over_limit(t: &Tenant, r: tenants::Refusal) -> (&'static str, GatewayError, Option<Duration>) {
    let what = r.over.reason();
    (
        what,
        GatewayError::TooManyRequests(format!(
            "tenant {} is over its {what} limit; retry in {} ms",
            t.name,
            r.retry_after.as_millis()
        )),
        Some(r.retry_after),
    )
}

/// The tenant may call the model (by the name sent, or the service or route it resolves
/// to) and its limits admit the request: its ticket. Else the rejection's reason, error
/// and `Retry-After`.
#[allow(clippy::type_complexity)]
fn tenant_gate(
    t: &Arc<Tenant>,
    rt: &Runtime,
    info: &RequestInfo,
) -> Result<Ticket, (&'static str, GatewayError, Option<Duration>)> {
    let allowed =
        t.allows(&info.model) || rt.resolve(&info.model).is_some_and(|d| t.allows(d.name()));
    if !allowed {
        return Err((
            "model_not_allowed",
            GatewayError::ModelNotAllowed(format!(
                "model {:?} is not allowed for tenant {}; GET /v1/models lists its models",
                info.model, t.name
            )),
            None,
        ));
    }
    let output = info.max_tokens.unwrap_or(tenants::DEFAULT_OUTPUT_RESERVE);
    tenants::admit(t, info.prompt_tokens_est, output).map_err(|r| over_limit(t, r))
}

/// `GET /v1/models`, `GET /health`, and the errors for every other path.
async fn local_endpoint(session: &mut Session, ctx: &mut Ctx, rt: &Runtime) -> Result<()> {
    let req = session.req_header();
    let path = req.uri.path().to_string();
    let method = req.method.clone();
    match (method.as_str(), path.trim_end_matches('/')) {
        ("GET", "/v1/models") => {
            let tenant = match authorize(req, rt) {
                Ok(t) => t,
                Err(e) => return reject(session, ctx, e.status(), e).await.map(|_| ()),
            };
            ctx.local_status = Some(200);
            let body = serde_json::to_vec(&rt.models(tenant.as_deref())).unwrap_or_default();
            respond(session, 200, "application/json", body, &ctx.request_id).await
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
            .await
        }
        (_, "/v1/models") | (_, "/health") => {
            let e = GatewayError::MethodNotAllowed(format!(
                "method {method} is not allowed on {path}; use GET"
            ));
            reject(session, ctx, e.status(), e).await.map(|_| ())
        }
        _ => {
            let e = GatewayError::NotFound(format!(
                "unknown path {path}; tokengate serves POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and GET /v1/models"
            ));
            reject(session, ctx, e.status(), e).await.map(|_| ())
        }
    }
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
            Ok(Err(e)) if e.etype() == &ErrorType::ReadTimedout => return slow(),
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
        1 => parts.pop().unwrap_or_default(),
        _ => {
            let mut v = Vec::with_capacity(len);
            for p in &parts {
                v.extend_from_slice(p);
            }
            Bytes::from(v)
        }
    }))
}
