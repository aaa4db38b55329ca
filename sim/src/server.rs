//! HTTP/1.1 front end (hyper) with fault injection, the HTTP side of the
//! prefill/decode disaggregation protocols ([`crate::pd`]) and SGLang's
//! `POST /abort_request` ([`crate::abort`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use parking_lot::RwLock;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use crate::abort::{Aborts, Target, Ticket};
use crate::api::{self, Api, Meta, StreamFmt};
use crate::decision;
use crate::engine::{Engine, Ev, Submit, Usage};
use crate::kvcache::{block_hashes_at, token_count_at};
use crate::pd::{self, DecodeReq, KvInfo, Plan, PrefillJob, Registry};
use crate::task::AbortOnDrop;
use crate::{Faults, Role, SimConfig};

/// Error that makes hyper drop the connection without (the rest of) a response.
#[derive(Debug)]
pub(crate) struct Abort(pub String);

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Abort {}

fn abort(msg: impl Into<String>) -> Abort {
    Abort(msg.into())
}

type BoxError = Abort;

pub(crate) struct Shared {
    pub cfg: Arc<SimConfig>,
    pub engine: Arc<Engine>,
    pub faults: RwLock<Faults>,
    /// PD prefill: KV published for decode engines.
    pub pd: Arc<Registry>,
    /// In-flight inference requests, for `POST /abort_request`.
    aborts: Arc<Aborts>,
    fault_draws: AtomicU64,
    ids: AtomicU64,
    id_header: HeaderValue,
    started: u64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Shared {
    pub(crate) fn new(cfg: Arc<SimConfig>, engine: Arc<Engine>) -> Arc<Self> {
        let id_header = HeaderValue::from_str(&cfg.id).unwrap_or(HeaderValue::from_static("sim"));
        Arc::new(Shared {
            faults: RwLock::new(cfg.faults.clone()),
            pd: Arc::new(Registry::new(&cfg)),
            aborts: Arc::default(),
            cfg,
            engine,
            fault_draws: AtomicU64::new(0),
            ids: AtomicU64::new(0),
            id_header,
            started: unix_now(),
        })
    }
}

/// Response body: a full buffer or an SSE stream fed by the scheduler.
pub(crate) enum SimBody {
    Full(Option<Bytes>),
    Sse(Box<SseBody>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SseState {
    Streaming,
    /// The close_after_chunks limit was reached: yield once so hyper
    /// flushes what was sent, then fail the body (hyper drops the connection).
    AbortPending,
    Abort,
    Finished,
}

pub(crate) struct SseBody {
    /// Registered while the stream lives. Declared before `rx` so it is dropped
    /// first: once the scheduler sees the stream gone, the request is
    /// unregistered.
    ticket: Ticket,
    rx: mpsc::UnboundedReceiver<Ev>,
    fmt: StreamFmt,
    close_after: Option<u64>,
    state: SseState,
    pending: Option<String>,
}

impl SseBody {
    fn handle(&mut self, ev: Ev, out: &mut String) {
        match ev {
            Ev::Admitted { cached } => self.fmt.admitted(out, cached),
            Ev::Tokens { upto } => self.fmt.tokens(out, upto),
            Ev::Done(u) => self.fmt.done(out, &u),
            Ev::Failed { status, message } => self.fmt.failed(out, status, &message),
            Ev::Aborted => self.fmt.aborted(out, &self.ticket.message()),
        }
    }

    fn limit_reached(&self) -> bool {
        self.close_after.is_some_and(|n| self.fmt.chunks >= n)
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Sse(s) => {
                let s = &mut **s;
                loop {
                    match s.state {
                        SseState::Finished => {
                            return Poll::Ready(s.pending.take().map(|p| Ok(Frame::data(p.into()))))
                        }
                        SseState::Abort => {
                            return Poll::Ready(Some(Err(abort(
                                "engine-sim: close_after_chunks fault",
                            ))))
                        }
                        SseState::AbortPending => {
                            if let Some(p) = s.pending.take() {
                                return Poll::Ready(Some(Ok(Frame::data(p.into()))));
                            }
                            s.state = SseState::Abort;
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                        SseState::Streaming => {}
                    }
                    if s.limit_reached() {
                        s.state = SseState::AbortPending;
                        continue;
                    }
                    let mut out = s.pending.take().unwrap_or_default();
                    let mut closed = false;
                    while out.len() < 32 * 1024 {
                        match s.rx.poll_recv(cx) {
                            Poll::Ready(Some(ev)) => {
                                s.handle(ev, &mut out);
                                if s.fmt.finished {
                                    s.state = SseState::Finished;
                                    break;
                                }
                                if s.limit_reached() {
                                    s.state = SseState::AbortPending;
                                    break;
                                }
                            }
                            Poll::Ready(None) => {
                                closed = true;
                                break;
                            }
                            Poll::Pending => break,
                        }
                    }
                    if closed {
                        // engine went away without finishing
                        s.state = SseState::AbortPending;
                    }
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out.into()))));
                    }
                    if s.state == SseState::Streaming {
                        return Poll::Pending;
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Sse(_) => SizeHint::default(),
        }
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<SimBody> {
    let mut r = Response::new(SimBody::Full(Some(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn error_response(api: Option<Api>, status: u16, msg: &str) -> Response<SimBody> {
    json_response(
        StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
        &api::error_body(api, status, msg),
    )
}

fn not_found() -> Response<SimBody> {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

fn is_inference(path: &str) -> Option<Api> {
    match path {
        "/v1/chat/completions" => Some(Api::Chat),
        "/v1/completions" => Some(Api::Completions),
        "/v1/responses" => Some(Api::Responses),
        "/v1/messages" => Some(Api::Messages),
        _ => None,
    }
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, BoxError> {
    match req.into_body().collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(abort(format!("reading request body: {e}"))),
    }
}

/// The PD endpoints under `/sim/pd/` ([`pd::endpoint`]).
async fn pd_endpoint(
    shared: &Shared,
    rest: &str,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, BoxError> {
    let method = req.method().clone();
    let query = req.uri().query().map(str::to_owned);
    let body = read_body(req).await?;
    let (status, v) = pd::endpoint(
        &shared.cfg,
        &shared.pd,
        &method,
        rest,
        query.as_deref(),
        &body,
    )
    .await;
    Ok(json_response(status, &v))
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    local: SocketAddr,
    bootstrap_only: bool,
) -> Result<Response<SimBody>, BoxError> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    if bootstrap_only {
        // The separate SGLang bootstrap port: its health check and the rooms.
        if let Some(rest) = path.strip_prefix("/sim/pd/") {
            return pd_endpoint(&shared, rest, req).await;
        }
        return Ok(match (method, path.as_str()) {
            (Method::GET, "/health") => Response::new(SimBody::Full(Some(Bytes::from("OK")))),
            _ => not_found(),
        });
    }
    if let Some(rest) = path.strip_prefix("/admin/") {
        return admin(&shared, method, rest, req).await;
    }
    let faults = shared.faults.read().clone();
    if faults.refuse {
        return Err(abort("engine-sim: refuse fault"));
    }
    let cfg = &shared.cfg;
    if let Some(api) = is_inference(&path) {
        if method != Method::POST {
            return Ok(json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"detail": "Method Not Allowed"}),
            ));
        }
        return inference(&shared, api, req, faults, local).await;
    }
    if let Some(rest) = path.strip_prefix("/sim/pd/") {
        return pd_endpoint(&shared, rest, req).await;
    }
    if path == "/abort_request" {
        return abort_request(&shared, method, req).await;
    }
    let resp = match (method, path.as_str()) {
        (Method::GET, "/health" | "/ping" | "/health_generate") => {
            let mut r = Response::new(SimBody::Full(None));
            *r.status_mut() = StatusCode::OK;
            r
        }
        (Method::GET, "/version") => json_response(StatusCode::OK, &json!({"version": "0.11.0"})),
        (Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{
                "id": cfg.model, "object": "model", "created": shared.started,
                "owned_by": "vllm", "root": cfg.model, "parent": null,
                "max_model_len": cfg.max_model_len,
                "permission": [],
            }]}),
        ),
        (Method::GET, "/get_model_info" | "/model_info") => json_response(
            StatusCode::OK,
            &json!({
                "model_path": cfg.model, "tokenizer_path": cfg.model, "is_generation": true,
                "preferred_sampling_params": null, "weight_version": "default",
                "has_image_understanding": false, "has_audio_understanding": false,
                "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            }),
        ),
        (Method::GET, "/get_server_info" | "/server_info") => {
            let st = shared.engine.stats();
            json_response(
                StatusCode::OK,
                &json!({
                    "model_path": cfg.model, "tokenizer_path": cfg.model,
                    "served_model_name": cfg.model, "is_embedding": false,
                    "context_length": cfg.max_model_len, "page_size": cfg.block_size,
                    "max_running_requests": cfg.max_running,
                    "max_total_num_tokens": cfg.kv_blocks * cfg.block_size,
                    "disaggregation_mode": match cfg.role {
                        Role::Integrated => "null",
                        r => r.as_str(),
                    },
                    "dp_size": 1, "tp_size": 1,
                    "version": "0.5.0-engine-sim", "engine_id": cfg.id,
                    "internal_states": [{
                        "num_running_reqs": st.running, "num_waiting_reqs": st.waiting,
                        "token_usage": st.kv_usage, "avg_spec_accept_length": null,
                    }],
                }),
            )
        }
        (Method::GET, "/metrics") => {
            let text = crate::metrics::render(cfg, &shared.engine.snapshot());
            let mut r = Response::new(SimBody::Full(Some(text.into())));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        (Method::POST, "/reset_prefix_cache") => {
            shared.engine.reset_prefix_cache();
            Response::new(SimBody::Full(None))
        }
        _ => not_found(),
    };
    Ok(resp)
}

async fn admin(
    shared: &Shared,
    method: Method,
    rest: &str,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, BoxError> {
    Ok(match (method, rest) {
        (Method::GET, "faults") => json_response(StatusCode::OK, &json!(*shared.faults.read())),
        (Method::POST | Method::PUT, "faults") => {
            let body = read_body(req).await?;
            let body = if body.iter().all(u8::is_ascii_whitespace) {
                Bytes::from_static(b"{}")
            } else {
                body
            };
            match serde_json::from_slice::<Faults>(&body) {
                Ok(f) => {
                    *shared.faults.write() = f.clone();
                    json_response(StatusCode::OK, &json!(f))
                }
                Err(e) => error_response(None, 400, &format!("invalid faults: {e}")),
            }
        }
        (Method::GET, "stats") => json_response(StatusCode::OK, &json!(shared.engine.stats())),
        _ => not_found(),
    })
}

/// SGLang's `POST /abort_request`: `{"rid": "<rid>"}` aborts the in-flight
/// requests whose body carried that rid, `{"abort_all": true}` all of them.
/// 200 `{"aborted": n}` (n requests signalled; an unknown rid is not an error),
/// 400 for a body that is not such a JSON object.
async fn abort_request(
    shared: &Shared,
    method: Method,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, BoxError> {
    if method != Method::POST {
        return Ok(json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"detail": "Method Not Allowed"}),
        ));
    }
    let body = read_body(req).await?;
    let bad = |msg: &str| Ok(error_response(None, 400, msg));
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad(&format!("invalid JSON body: {e}")),
    };
    let Some(o) = v.as_object() else {
        return bad(r#"the body must be a JSON object: {"rid": "<rid>"} or {"abort_all": true}"#);
    };
    let abort_all = match o.get("abort_all") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return bad(&format!("abort_all must be a boolean, got {other}")),
    };
    let rid = match o.get("rid") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return bad(&format!("rid must be a string, got {other}")),
    };
    let n = if abort_all {
        shared.aborts.abort(Target::All)
    } else if rid.is_empty() {
        // SGLang ignores an empty rid without abort_all
        0
    } else {
        shared.aborts.abort(Target::Rid(rid))
    };
    if n > 0 {
        shared.engine.abort_signalled();
    }
    log::debug!(
        "engine-sim {}: abort_request rid={rid:?} abort_all={abort_all}: {n} request(s)",
        shared.cfg.id
    );
    Ok(json_response(StatusCode::OK, &json!({"aborted": n})))
}

async fn inference(
    shared: &Shared,
    api: Api,
    req: Request<Incoming>,
    faults: Faults,
    local: SocketAddr,
) -> Result<Response<SimBody>, BoxError> {
    let arrived = tokio::time::Instant::now();
    if faults.stall_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.stall_ms)).await;
    }
    let cfg = &shared.cfg;
    let override_tokens = req
        .headers()
        .get("x-sim-output-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let raw = read_body(req).await?;
    let parsed = match api::parse(api, &raw) {
        Ok(p) => p,
        Err(e) => return Ok(error_response(Some(api), 400, &e)),
    };
    if let Some(r) = refusal(shared, api, parsed.model.as_deref(), &faults) {
        return Ok(r);
    }
    let plan = match pd::plan(cfg, &parsed.pd) {
        Ok(p) => p,
        Err(e) => return Ok(error_response(Some(api), 400, &e)),
    };
    let prompt_tokens = token_count_at(&parsed.prompt, cfg.bytes_per_token);
    // Decision mode: the answer is a target name; its length sets the output
    // (cut by max_tokens like a real model), x-sim-output-tokens is ignored.
    let answer = if cfg.decision_mode {
        api::decision_texts(api, &raw).and_then(|(system, user)| decision::choose(&system, &user))
    } else {
        None
    };
    let (output_tokens, length_limited) = output_length(
        cfg,
        answer.as_deref(),
        override_tokens,
        parsed.max_tokens,
        plan.is_prefill(),
    );
    if prompt_tokens + output_tokens > cfg.max_model_len
        || shared.engine.blocks_needed(prompt_tokens, output_tokens) > cfg.kv_blocks
    {
        if let Plan::SglPrefill { room } = plan {
            // the decode waiting for this room fails now
            shared
                .pd
                .fail(&pd::room_key(room), "the prefill rejected the request");
        }
        return Ok(error_response(
            Some(api),
            400,
            &format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                cfg.max_model_len.min(cfg.kv_blocks * cfg.block_size),
                prompt_tokens + output_tokens,
                prompt_tokens,
                output_tokens
            ),
        ));
    }
    let hashes = block_hashes_at(&parsed.prompt, cfg.block_size, cfg.bytes_per_token);
    let prompt_hash = xxhash_rust::xxh3::xxh3_64(&parsed.prompt);
    let seed = hashes.first().copied().unwrap_or(prompt_hash);
    let n = shared.ids.fetch_add(1, Ordering::Relaxed);
    let tag = format!(
        "{:08x}{n:08x}",
        xxhash_rust::xxh3::xxh3_64(cfg.id.as_bytes()) as u32
    );
    let id = match api {
        Api::Chat => format!("chatcmpl-{tag}"),
        Api::Completions => format!("cmpl-{tag}"),
        Api::Responses => format!("resp_{tag}"),
        Api::Messages => format!("msg_{tag}"),
    };
    // Abortable from here on, until the response ends (the ticket lives in this
    // function, or in the SSE body).
    let ticket = shared.aborts.register(parsed.rid.clone(), &id);
    // PD decode: the prompt's KV comes from the prefill engine first.
    let mut remote_cached = None;
    if matches!(plan, Plan::SglDecode { .. } | Plan::VllmDecode(_)) {
        let req = DecodeReq {
            rid: ticket.name(),
            prompt_tokens: prompt_tokens as u32,
            prompt_hash,
            arrived: arrived.into_std(),
        };
        match pd::receive_kv(&shared.engine, cfg, &plan, req, ticket.signal()).await {
            Ok(info) => remote_cached = Some(info.cached_tokens.min(prompt_tokens as u32)),
            Err(msg) => return Ok(error_response(Some(api), 500, &msg)),
        }
    }
    // PD prefill: the KV is handed over when the prefill finishes.
    let (job, kv_params) = prefill_job(
        shared,
        &plan,
        &ticket,
        &id,
        prompt_tokens,
        prompt_hash,
        local,
    );
    let (tx, rx) = mpsc::unbounded_channel();
    shared.engine.submit(Submit {
        hashes,
        prompt_tokens: prompt_tokens as u32,
        output_tokens: output_tokens as u32,
        stream: parsed.stream,
        length_limited,
        hold: job.as_ref().map(|j| j.hold),
        remote_cached,
        abort: Some(ticket.signal()),
        tx,
    });
    let rx = match job {
        Some(job) => pd::relay_prefill(
            shared.engine.clone(),
            shared.pd.clone(),
            shared.cfg.clone(),
            job,
            rx,
        ),
        None => rx,
    };
    let meta = Meta {
        api,
        id,
        item_id: format!("msg_{tag}"),
        model: cfg.model.clone(),
        created: unix_now(),
        seed,
        length_limited,
        include_usage: parsed.include_usage,
        target: output_tokens as u32,
        answer,
    };
    let first_byte_at = arrived + Duration::from_millis(faults.first_byte_delay_ms);
    if parsed.stream {
        let body = sse_body(meta, prompt_tokens, ticket, rx, &faults);
        return Ok(stream_response(body, &faults, first_byte_at).await);
    }
    unary_response(api, meta, ticket, rx, &faults, first_byte_at, kv_params).await
}

/// An answer before any work: an unknown model (404), or an injected fault (429 with
/// `Retry-After`, or `error_rate`'s status).
fn refusal(
    shared: &Shared,
    api: Api,
    model: Option<&str>,
    faults: &Faults,
) -> Option<Response<SimBody>> {
    let cfg = &shared.cfg;
    if let Some(m) = model {
        if m != cfg.model {
            return Some(error_response(
                Some(api),
                404,
                &format!("The model `{m}` does not exist."),
            ));
        }
    }
    if faults.rate_limit {
        let mut r = error_response(
            Some(api),
            429,
            "Too many requests (engine-sim rate_limit fault)",
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(faults.retry_after_s));
        return Some(r);
    }
    let draw = shared.fault_draws.fetch_add(1, Ordering::Relaxed);
    if faults.should_error(draw) {
        return Some(error_response(
            Some(api),
            faults.error_status,
            "Injected server error (engine-sim error_rate fault)",
        ));
    }
    None
}

/// The output length of a request, and whether `max_tokens` cut it: a decision-mode answer's
/// own length (cut by `max_tokens` like a real model; `x-sim-output-tokens` is ignored), else
/// `x-sim-output-tokens`, else `max_tokens`, else the default. A PD prefill produces the
/// first token only (SGLang: FINISH_LENGTH(0); vLLM's proxy sends max_tokens 1).
fn output_length(
    cfg: &SimConfig,
    answer: Option<&str>,
    override_tokens: Option<u64>,
    max_tokens: Option<u64>,
    prefill: bool,
) -> (usize, bool) {
    if prefill {
        return (1, true);
    }
    let (n, length_limited) = match (answer, override_tokens, max_tokens) {
        (Some(a), _, max) => {
            let n = api::answer_tokens(a) as u64;
            match max {
                Some(m) if m < n => (m, true),
                _ => (n, false),
            }
        }
        (None, Some(n), _) => (n, false),
        (None, None, Some(n)) => (n, true),
        (None, None, None) => (cfg.default_output_tokens as u64, false),
    };
    (n.clamp(1, u32::MAX as u64 / 2) as usize, length_limited)
}

/// A PD prefill's hand-over of its KV once it finishes (`None` for any other request), and
/// for vLLM the `kv_transfer_params` its response carries.
fn prefill_job(
    shared: &Shared,
    plan: &Plan,
    ticket: &Ticket,
    id: &str,
    prompt_tokens: usize,
    prompt_hash: u64,
    local: SocketAddr,
) -> (Option<PrefillJob>, Option<Value>) {
    let cfg = &shared.cfg;
    match plan {
        Plan::SglPrefill { room } => {
            let job = PrefillJob {
                key: pd::room_key(*room),
                hold: shared.pd.next_hold(),
                info: KvInfo {
                    engine_id: cfg.id.clone(),
                    prompt_tokens: prompt_tokens as u32,
                    cached_tokens: 0,
                    prompt_hash,
                    block_ids: Vec::new(),
                },
                what: format!("rid={} bootstrap_room={room}", ticket.name()),
                name: ticket.name().to_string(),
                abort: ticket.signal(),
            };
            (Some(job), None)
        }
        Plan::VllmPrefill => {
            let block_ids = shared.pd.block_ids(prompt_tokens.div_ceil(cfg.block_size));
            let kv_params = json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_block_ids": block_ids,
                "remote_engine_id": cfg.id,
                "remote_request_id": id,
                "remote_host": local.ip().to_string(),
                "remote_port": local.port(),
                "tp_size": 1,
            });
            let job = PrefillJob {
                key: pd::transfer_key(id),
                hold: shared.pd.next_hold(),
                info: KvInfo {
                    engine_id: cfg.id.clone(),
                    prompt_tokens: prompt_tokens as u32,
                    cached_tokens: 0,
                    prompt_hash,
                    block_ids,
                },
                what: id.to_string(),
                name: ticket.name().to_string(),
                abort: ticket.signal(),
            };
            (Some(job), Some(kv_params))
        }
        _ => (None, None),
    }
}

/// A streamed answer's body: the engine's events as server-sent events.
fn sse_body(
    meta: Meta,
    prompt_tokens: usize,
    ticket: Ticket,
    rx: mpsc::UnboundedReceiver<Ev>,
    faults: &Faults,
) -> SseBody {
    let mut fmt = StreamFmt::new(meta, prompt_tokens as u32);
    let mut start = String::new();
    fmt.start(&mut start);
    SseBody {
        ticket,
        rx,
        fmt,
        close_after: faults.close_after_chunks,
        state: SseState::Streaming,
        pending: (!start.is_empty()).then_some(start),
    }
}

/// The streamed answer's response, sent no earlier than `first_byte_at`.
async fn stream_response(
    body: SseBody,
    faults: &Faults,
    first_byte_at: tokio::time::Instant,
) -> Response<SimBody> {
    if faults.first_byte_delay_ms > 0 {
        tokio::time::sleep_until(first_byte_at).await;
    }
    let mut r = Response::new(SimBody::Sse(Box::new(body)));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// A non-streamed answer: the engine's events awaited, then the whole body (with vLLM's
/// `kv_transfer_params` for a prefill), no earlier than `first_byte_at`.
async fn unary_response(
    api: Api,
    meta: Meta,
    ticket: Ticket,
    mut rx: mpsc::UnboundedReceiver<Ev>,
    faults: &Faults,
    first_byte_at: tokio::time::Instant,
    kv_params: Option<Value>,
) -> Result<Response<SimBody>, BoxError> {
    let mut usage: Option<Usage> = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            Ev::Done(u) => {
                usage = Some(u);
                break;
            }
            Ev::Failed { status, message } => {
                return Ok(error_response(Some(api), status, &message));
            }
            Ev::Aborted => return Ok(error_response(Some(api), 500, &ticket.message())),
            _ => {}
        }
    }
    let Some(usage) = usage else {
        return Err(abort("engine-sim: engine stopped"));
    };
    if faults.close_after_chunks.is_some() {
        return Err(abort("engine-sim: close_after_chunks fault (non-stream)"));
    }
    if faults.first_byte_delay_ms > 0 {
        tokio::time::sleep_until(first_byte_at).await;
    }
    let mut body = meta.full_response(&usage);
    if let (Some(p), Some(o)) = (kv_params, body.as_object_mut()) {
        o.insert("kv_transfer_params".into(), p);
    }
    Ok(json_response(StatusCode::OK, &body))
}

/// While refusing, only connections whose request line targets /admin/ are
/// served. Peeks (without consuming) up to 200 ms for the request line.
async fn is_admin_conn(stream: &TcpStream) -> bool {
    const PREFIXES: [&[u8]; 3] = [b"GET /admin/", b"POST /admin/", b"PUT /admin/"];
    let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut buf = [0u8; 16];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return false,
        };
        let got = &buf[..n];
        if PREFIXES.iter().any(|p| got.starts_with(p)) {
            return true;
        }
        if !PREFIXES.iter().any(|p| p.starts_with(got)) || n == buf.len() {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
    }
}

async fn serve_conn(shared: Arc<Shared>, stream: TcpStream, bootstrap_only: bool) {
    if shared.faults.read().refuse && !is_admin_conn(&stream).await {
        // reset the connection
        let _ = stream.set_zero_linger();
        drop(stream);
        return;
    }
    let _ = stream.set_nodelay(true);
    let local = stream
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)));
    let svc_shared = shared.clone();
    let svc = hyper::service::service_fn(move |req| {
        let shared = svc_shared.clone();
        async move {
            let id = shared.id_header.clone();
            let mut r = handle(shared, req, local, bootstrap_only).await?;
            r.headers_mut().insert("x-engine-id", id);
            Ok::<_, BoxError>(r)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive(true)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        log::debug!("engine-sim {}: connection ended: {e}", shared.cfg.id);
    }
}

async fn accept_opt(l: &Option<TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

pub(crate) async fn accept_loop(
    listener: TcpListener,
    bootstrap: Option<TcpListener>,
    shared: Arc<Shared>,
    mut shutdown: oneshot::Receiver<()>,
    scheduler: AbortOnDrop,
) {
    let mut conns: JoinSet<()> = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    conns.spawn(serve_conn(shared.clone(), stream, false));
                }
                Err(e) => {
                    log::warn!("engine-sim {}: accept failed: {e}", shared.cfg.id);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            r = accept_opt(&bootstrap) => match r {
                Ok((stream, _)) => {
                    conns.spawn(serve_conn(shared.clone(), stream, true));
                }
                Err(e) => {
                    log::warn!("engine-sim {}: bootstrap accept failed: {e}", shared.cfg.id);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    drop(listener);
    drop(bootstrap);
    conns.shutdown().await;
    drop(scheduler);
}
