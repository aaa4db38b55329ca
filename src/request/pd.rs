//! Prefill/decode disaggregation: one request, two engines.
//!
//! The plan picks a pair ([`super::plan`]): the service's scheduler (affinity, prefix cache,
//! predicted TTFT — the KV cache lives on the prefill side) chooses the **prefill**
//! instance, `pd.decode_policy` the **decode** instance. The decode instance is the main leg:
//! its response streams to the client through Pingora like any other. The prefill leg is
//! sent here, beside it, in one of two protocols:
//!
//! * **`sglang-mooncake`** (SGLang's router): `bootstrap_host` (the prefill's host),
//!   `bootstrap_port` (its `--disaggregation-bootstrap-port`), a fresh random
//!   `bootstrap_room` and a request id `rid` go into the body, which is sent to the prefill
//!   (a task here) and the decode (Pingora) at once; the decode engine fetches the KV from
//!   the prefill's bootstrap server. The prefill's response is read to its end and dropped
//!   (its usage is kept: its cached tokens are the prefix cache's truth).
//! * **`vllm-nixl`** (vLLM's disaggregated proxy): the prefill first, with `max_tokens: 1`,
//!   `stream: false`, no `stream_options` and `kv_transfer_params: {do_remote_decode: true,
//!   …}`; its answer's `kv_transfer_params` (where the KV is) go into the original body for
//!   the decode.
//!
//! Failures: the prefill's outcome is a [`Side`] state that dispatch and completion read.
//! A prefill that fails (connection, timeout, an error status) makes the gateway abort the
//! decode (SGLang: `POST /abort_request {"rid"}` on the decode instance, which then answers
//! at once instead of waiting for a KV that never comes); a decode that fails aborts the
//! prefill the same way. Before any byte reached the client the attempt is retried with a
//! fresh room on a new pair, without the instance to blame (the prefill when it failed,
//! else the decode); a prefill's 4xx (a bad request) is the client's answer. Each leg holds
//! its own load guard: the prefill's is released when the prefill ends (not when the
//! decode ends), so the prefill nodes' load table counts prefill work only.

use super::{Ctx, Guard, LegRole, Plan, To};
use crate::config::PdMode;
use crate::error::GatewayError;
use crate::load::{LoadGuard, Outcome};
use crate::runtime::Instance;
use crate::shared::Shared;
use crate::usage::{JsonCollector, SseScanner, Usage};
use bytes::Bytes;
use log::{debug, warn};
use parking_lot::Mutex;
use pingora::proxy::Session;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokengate_plugins::InstanceKey;
use tokio::sync::watch;

/// How long an abort call to an engine may take.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);
/// A decode that failed while its prefill still runs: how long to wait for the prefill's
/// own outcome before blaming the decode (the decode's error is often the prefill's).
const SETTLE: Duration = Duration::from_millis(200);
/// Largest error body read from a failed prefill (for the message).
const MAX_ERROR_BODY: usize = 16 * 1024;

/// Why a prefill failed.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The prefill's status, when it answered one.
    pub status: Option<u16>,
    pub message: String,
}

impl Failure {
    /// Another pair may do better: no answer, a timeout, overload or a server error. A 4xx
    /// says the request itself is wrong.
    pub fn retryable(&self) -> bool {
        self.status.is_none_or(|s| s >= 500 || s == 408 || s == 429)
    }

    /// The prefill instance is to blame (passive health): no answer or a 5xx.
    fn instance_failed(&self) -> bool {
        self.status.is_none_or(|s| s >= 500)
    }

    /// The error the client gets when no retry is left (or the request is bad).
    /// A bad request says the engine's message; any other failure says what failed and
    /// leaves the detail (addresses, OS errors) to the log line, with the request id.
    pub fn gateway_error(&self, prefill: &str, request_id: &str) -> GatewayError {
        if self
            .status
            .is_some_and(|s| (400..500).contains(&s) && !self.retryable())
        {
            return GatewayError::BadRequest(format!(
                "prefill instance {prefill} failed: {}",
                self.message
            ));
        }
        log::warn!(
            "request {request_id}: prefill instance {prefill} failed: {}",
            self.message
        );
        let msg = match self.status {
            Some(s) => format!(
                "prefill instance {prefill} answered {s} (request id {request_id}: details in the gateway's log)"
            ),
            None => format!(
                "prefill instance {prefill} failed (request id {request_id}: details in the gateway's log)"
            ),
        };
        match self.status {
            Some(503) | Some(429) => GatewayError::Unavailable(msg),
            _ => GatewayError::BadGateway(msg),
        }
    }
}

/// The prefill's progress, as the dispatch and completion phases read it.
#[derive(Debug, Clone, Default)]
pub enum State {
    #[default]
    Running,
    /// The prefill's response ended well: its usage and how long it took.
    Done {
        usage: Usage,
        ms: f64,
    },
    Failed(Failure),
    /// The gateway gave up on it (the decode failed, the client left).
    Aborted,
}

/// The prefill leg's shared half: its load guard (released by whoever ends the prefill:
/// the task that reads its response, or the request when it gives up on it) and its state.
pub struct Side {
    guard: Mutex<Option<LoadGuard<Instance>>>,
    state: watch::Sender<State>,
    instance: Arc<Instance>,
    counter: prometheus::IntCounterVec,
}

impl std::fmt::Debug for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side")
            .field("instance", &self.instance.id)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl Side {
    fn new(guard: LoadGuard<Instance>, counter: prometheus::IntCounterVec) -> Arc<Side> {
        let instance = guard.instance().clone();
        Arc::new(Side {
            guard: Mutex::new(Some(guard)),
            state: watch::Sender::new(State::Running),
            instance,
            counter,
        })
    }

    pub fn state(&self) -> State {
        self.state.borrow().clone()
    }

    pub fn failure(&self) -> Option<Failure> {
        match &*self.state.borrow() {
            State::Failed(f) => Some(f.clone()),
            _ => None,
        }
    }

    pub fn running(&self) -> bool {
        matches!(*self.state.borrow(), State::Running)
    }

    /// The prefill phase ended (its first token is the decode's business).
    pub fn first_token(&self) {
        if let Some(g) = self.guard.lock().as_mut() {
            g.first_token();
        }
    }

    /// Releases the prefill's load with `o` (once; later calls do nothing).
    pub fn finish(&self, o: Outcome) {
        let g = self.guard.lock().take();
        if let Some(mut g) = g {
            g.first_token();
            g.finish(o);
        }
    }

    /// Sets the final state (the first one wins) and counts it.
    fn settle(&self, s: State) -> bool {
        let label = match &s {
            State::Running => return false,
            State::Done { .. } => "ok",
            State::Failed(_) => "error",
            State::Aborted => "aborted",
        };
        let set = self.state.send_if_modified(|cur| {
            if matches!(cur, State::Running) {
                *cur = s;
                true
            } else {
                false
            }
        });
        if set {
            self.counter
                .with_label_values(&[self.instance.id.as_str(), label])
                .inc();
        }
        set
    }

    /// Waits until the prefill is no longer running, at most `d`.
    async fn settled(&self, d: Duration) {
        let mut rx = self.state.subscribe();
        let _ = tokio::time::timeout(d, rx.wait_for(|s| !matches!(s, State::Running))).await;
    }
}

/// The current attempt's pair.
pub struct Attempt {
    pub mode: PdMode,
    pub side: Arc<Side>,
    /// SGLang: the request id both engines know the request by (their abort key).
    pub rid: Option<String>,
    pub room: Option<u64>,
    pub prefill: Arc<Instance>,
    pub decode: Arc<Instance>,
    task: Option<tokio::task::JoinHandle<()>>,
    http: reqwest::Client,
}

impl Attempt {
    /// Gives up on a prefill that still runs: the engine is told to abort (SGLang) and the
    /// task reading its response is stopped (closing the connection, which engines also
    /// take as an abort); its load is released as cancelled.
    pub fn abort_prefill(&mut self) {
        if self.side.settle(State::Aborted) {
            if let Some(rid) = &self.rid {
                abort(&self.http, &self.prefill, rid);
            }
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.side.finish(Outcome::Cancelled);
    }

    /// The request ended with `outcome`. A prefill still reading its response after a
    /// completed request is left to end by itself (its task releases its load); otherwise it
    /// is aborted.
    pub fn end(mut self, outcome: Outcome) {
        if self.side.running() {
            if outcome == Outcome::Completed {
                self.task.take(); // detached: it ends by itself
                return;
            }
            self.abort_prefill();
        }
    }

    /// The instance a failed attempt blames: the prefill when it failed, else the decode.
    pub fn blamed(&self) -> InstanceKey {
        match self.side.failure() {
            Some(_) => self.prefill.key,
            None => self.decode.key,
        }
    }

    /// `p1+d1`.
    pub fn pair_name(&self) -> String {
        format!("{}+{}", self.prefill.id, self.decode.id)
    }
}

/// Waits (briefly) for the prefill's outcome after the decode answered `status`: a decode
/// error is often the consequence of a failed prefill, which is then the one to blame.
pub async fn settle_after_decode_error(ctx: &Ctx, status: u16) {
    if status < 400 {
        return;
    }
    if let Some(a) = ctx.pd.as_ref() {
        if a.mode == PdMode::SglangMooncake && a.side.running() {
            a.side.settled(SETTLE).await;
        }
    }
}

/// Asks an SGLang engine to abort request `rid` (fire and forget). The other side of a pair
/// may not have reached its engine yet when the abort is sent (both are sent at once): an
/// abort of an unknown id does nothing, and that request would then wait out its KV timeout.
/// So the abort is repeated a few times over about 1.5 s, unless the engine says it aborted
/// something (engine-sim answers `{"aborted": n}`; SGLang's answer carries no count, so
/// every try is sent: harmless, the id is unique to this attempt).
fn abort(http: &reqwest::Client, inst: &Arc<Instance>, rid: &str) {
    let http = http.clone();
    let rid = rid.to_string();
    let inst = inst.clone();
    tokio::spawn(async move {
        let addr = inst.addr;
        for (i, wait_ms) in ABORT_RETRY_MS.iter().enumerate() {
            if *wait_ms > 0 {
                tokio::time::sleep(Duration::from_millis(*wait_ms)).await;
            }
            let r = inst
                .request(&http, reqwest::Method::POST, "/abort_request")
                .timeout(ABORT_TIMEOUT)
                .json(&json!({ "rid": rid }))
                .send()
                .await;
            match r {
                Ok(r) if r.status().is_success() => {
                    let n = r
                        .json::<Value>()
                        .await
                        .ok()
                        .and_then(|v| v.get("aborted").and_then(Value::as_u64));
                    debug!("abort {i} of request {rid} on {addr}: {n:?} aborted");
                    if n.is_some_and(|n| n > 0) {
                        return;
                    }
                }
                Ok(r) => debug!("abort of request {rid} on {addr}: {}", r.status()),
                Err(e) => debug!("abort of request {rid} on {addr} failed: {e}"),
            }
        }
    });
}

/// Pauses before each try of an abort (see [`abort`]).
const ABORT_RETRY_MS: [u64; 5] = [0, 100, 200, 400, 800];

/// Dispatches the prefill side of the current attempt (the decode is the main leg, sent by
/// Pingora afterwards): sets the decode's body in `ctx.attempt.sent` and `ctx.pd`. `Err` when a
/// vLLM prefill failed (nothing was sent to the decode; the caller retries or answers).
pub async fn dispatch(
    shared: &Shared,
    session: &Session,
    ctx: &mut Ctx,
    plan: &Plan,
) -> Result<(), Failure> {
    let Some(pi) = ctx.legs.iter().position(|l| l.role == LegRole::Prefill) else {
        return Ok(());
    };
    let (Some(decode), Some(mode)) = (
        ctx.main_leg()
            .and_then(|l| l.local())
            .map(|l| l.instance.clone()),
        ctx.main_leg()
            .and_then(|l| l.local())
            .and_then(|l| l.service.pd.as_ref())
            .map(|p| p.mode),
    ) else {
        return Ok(());
    };
    let leg = &mut ctx.legs[pi];
    let now = std::time::Instant::now();
    leg.dispatched = Some(now);
    leg.dispatched_ms = crate::clock::now_ms();
    let To::Local(l) = &mut leg.to else {
        return Ok(());
    };
    let prefill = l.instance.clone();
    // The prefill leg's guard becomes shared with whoever ends the prefill.
    let side = match std::mem::replace(&mut l.guard, Guard::Gone) {
        Guard::Held(g) => Side::new(g, shared.metrics.pd_prefill.clone()),
        other => {
            l.guard = other;
            return Ok(());
        }
    };
    l.guard = Guard::Shared(side.clone());
    // The body both sides start from: the client's (its model rewritten), kept for retries.
    let base = ctx.upstream_body().cloned().unwrap_or_default();
    let path = session
        .req_header()
        .uri
        .path_and_query()
        .map_or("/v1/chat/completions", |p| p.as_str())
        .to_string();
    let mut headers = prefill_headers(session, ctx, plan, &prefill);
    if let Some(t) = ctx.trace.as_mut() {
        for (k, v) in t.prefill_start(&prefill.id, &prefill.addr.to_string()) {
            headers.insert(k, v);
        }
    }
    let t = &plan.runtime.timeouts;
    let http = match ctx.main_leg().and_then(|l| l.local()) {
        Some(l) => l.service.http.clone(),
        None => shared.pd_http.clone(),
    };
    let url = prefill.url(&path);
    match mode {
        PdMode::SglangMooncake => {
            let room = tokengate_plugins::rand::random::<u64>() & (i64::MAX as u64);
            let rid = format!("{}-{}", ctx.request_id, ctx.attempt.count);
            let host = prefill.addr.ip().to_string();
            let body = with_fields(
                &base,
                &[
                    ("bootstrap_host", Value::String(host)),
                    (
                        "bootstrap_port",
                        prefill.bootstrap_port.map_or(Value::Null, Value::from),
                    ),
                    ("bootstrap_room", Value::from(room)),
                    ("rid", Value::String(rid.clone())),
                ],
            )
            .map(Bytes::from)
            .unwrap_or(base);
            ctx.attempt.sent = Some(body.clone());
            let task = tokio::spawn(sglang_prefill(
                http.clone(),
                url,
                headers,
                body,
                (t.first_byte, t.total),
                side.clone(),
                (decode.clone(), rid.clone()),
                plan.runtime.clone(),
            ));
            ctx.pd = Some(Attempt {
                mode,
                side,
                rid: Some(rid),
                room: Some(room),
                prefill,
                decode,
                task: Some(task),
                http,
            });
            Ok(())
        }
        PdMode::VllmNixl => {
            let body = vllm_prefill_body(&base);
            let r = vllm_prefill(&http, &url, headers, body, t.first_byte).await;
            let started = now;
            let result = match r {
                Ok((params, usage)) => {
                    side.settle(State::Done {
                        usage,
                        ms: started.elapsed().as_secs_f64() * 1e3,
                    });
                    side.finish(Outcome::Completed);
                    passive(&prefill, false, plan);
                    let body = match params {
                        Some(p) => with_fields(&base, &[("kv_transfer_params", p)])
                            .map(Bytes::from)
                            .unwrap_or(base),
                        // No KV to hand over (a prompt shorter than a block): the decode
                        // prefills it, as vLLM's proxy does.
                        None => base,
                    };
                    ctx.attempt.sent = Some(body);
                    Ok(())
                }
                Err(f) => {
                    warn!(
                        "request {}: prefill instance {} failed: {}",
                        ctx.request_id, prefill.id, f.message
                    );
                    side.settle(State::Failed(f.clone()));
                    side.finish(Outcome::Failed);
                    passive(&prefill, f.instance_failed(), plan);
                    Err(f)
                }
            };
            ctx.pd = Some(Attempt {
                mode,
                side,
                rid: None,
                room: None,
                prefill,
                decode,
                task: None,
                http,
            });
            result
        }
    }
}

fn passive(inst: &Arc<Instance>, failed: bool, plan: &Plan) {
    inst.passive(failed, &plan.runtime.passive, crate::clock::now_ms());
}

/// The headers of the prefill request: JSON, the request id, and the engine's key (or the
/// client's when the gateway forwards it).
fn prefill_headers(
    session: &Session,
    ctx: &Ctx,
    plan: &Plan,
    inst: &Instance,
) -> reqwest::header::HeaderMap {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    if let Some(id) = ctx.request_id_header.clone() {
        h.insert("x-request-id", id);
    }
    if let Some(a) = inst.auth.clone() {
        h.insert(reqwest::header::AUTHORIZATION, a);
    } else if plan.forward_auth {
        let req = &session.req_header().headers;
        for k in ["authorization", "x-api-key"] {
            if let Some(v) = req.get(k) {
                h.insert(k, v.clone());
            }
        }
    }
    h
}

/// SGLang's prefill: sent beside the decode, read to its end. A failure tells the decode
/// to abort.
#[allow(clippy::too_many_arguments)]
async fn sglang_prefill(
    http: reqwest::Client,
    url: String,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
    (first_byte, total): (Duration, Duration),
    side: Arc<Side>,
    (decode, rid): (Arc<Instance>, String),
    rt: Arc<crate::runtime::Runtime>,
) {
    let started = Instant::now();
    let r = read_response(&http, &url, headers, body, first_byte, total).await;
    let failed = match r {
        Ok(usage) => {
            side.settle(State::Done {
                usage,
                ms: started.elapsed().as_secs_f64() * 1e3,
            });
            side.finish(Outcome::Completed);
            false
        }
        Err(f) => {
            let instance_failed = f.instance_failed();
            if side.settle(State::Failed(f.clone())) {
                warn!(
                    "prefill instance {} failed ({}); aborting request {rid} on the decode instance",
                    side.instance.id, f.message
                );
                abort(&http, &decode, &rid);
            }
            side.finish(Outcome::Failed);
            instance_failed
        }
    };
    side.instance
        .passive(failed, &rt.passive, crate::clock::now_ms());
}

/// Sends a prefill request and reads its response to the end: its usage, or why it failed.
async fn read_response(
    http: &reqwest::Client,
    url: &str,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
    first_byte: Duration,
    total: Duration,
) -> Result<Usage, Failure> {
    let fail = |status: Option<u16>, message: String| Failure { status, message };
    let send = http.post(url).headers(headers).body(body).send();
    let mut resp = match tokio::time::timeout(first_byte, send).await {
        Err(_) => {
            return Err(fail(
                None,
                format!("no answer within timeouts.first_byte ({first_byte:?})"),
            ))
        }
        Ok(Err(e)) => return Err(fail(None, error_chain(&e))),
        Ok(Ok(r)) => r,
    };
    let status = resp.status().as_u16();
    if !resp.status().is_success() {
        return Err(fail(Some(status), error_message(resp).await));
    }
    let sse = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut scanner = sse.then(|| SseScanner::new(false));
    let mut json = (!sse).then(JsonCollector::default);
    let read = async {
        loop {
            match resp.chunk().await {
                Ok(Some(c)) => {
                    if let Some(s) = scanner.as_mut() {
                        s.feed(&c);
                    } else if let Some(j) = json.as_mut() {
                        j.feed(&c);
                    }
                }
                Ok(None) => return Ok(()),
                Err(e) => return Err(error_chain(&e)),
            }
        }
    };
    match tokio::time::timeout(total, read).await {
        Err(_) => Err(fail(
            Some(status),
            format!("its response did not end within timeouts.total ({total:?})"),
        )),
        Ok(Err(e)) => Err(fail(None, format!("its response broke off: {e}"))),
        Ok(Ok(())) => Ok(match (scanner, json) {
            (Some(mut s), _) => {
                s.finish();
                s.usage
            }
            (_, Some(mut j)) => j.finish().unwrap_or_default(),
            _ => Usage::default(),
        }),
    }
}

/// vLLM's prefill: its `kv_transfer_params` (absent when there is no KV to hand over) and
/// its usage.
async fn vllm_prefill(
    http: &reqwest::Client,
    url: &str,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
    first_byte: Duration,
) -> Result<(Option<Value>, Usage), Failure> {
    let fail = |status: Option<u16>, message: String| Failure { status, message };
    let send = async {
        let resp = http
            .post(url)
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|e| fail(None, error_chain(&e)))?;
        let status = resp.status().as_u16();
        if !resp.status().is_success() {
            return Err(fail(Some(status), error_message(resp).await));
        }
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| fail(None, format!("its response broke off: {}", error_chain(&e))))?;
        Ok((status, bytes))
    };
    let (status, bytes) = match tokio::time::timeout(first_byte, send).await {
        Err(_) => {
            return Err(fail(
                None,
                format!("no answer within timeouts.first_byte ({first_byte:?})"),
            ))
        }
        Ok(r) => r?,
    };
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        fail(
            Some(status),
            format!("its answer is not JSON ({e}); is it a vLLM prefill instance?"),
        )
    })?;
    let mut j = JsonCollector::default();
    j.feed(&bytes);
    let usage = j.finish().unwrap_or_default();
    let params = v
        .get("kv_transfer_params")
        .filter(|p| p.is_object())
        .cloned();
    Ok((params, usage))
}

/// The error message of a failed answer: the API error's `message` when it has one.
async fn error_message(resp: reqwest::Response) -> String {
    let status = resp.status();
    let mut body = Vec::new();
    let mut resp = resp;
    while let Ok(Some(c)) = resp.chunk().await {
        body.extend_from_slice(&c);
        if body.len() >= MAX_ERROR_BODY {
            break;
        }
    }
    let msg = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
        let m = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))?;
        Some(m.as_str().map_or_else(|| m.to_string(), str::to_owned))
    });
    match msg {
        Some(m) => format!("{status}: {m}"),
        None => format!("{status}"),
    }
}

fn error_chain(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

/// vLLM's prefill request: one token, no stream, and the KV kept for a remote decode.
fn vllm_prefill_body(base: &[u8]) -> Bytes {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(base) else {
        return Bytes::copy_from_slice(base);
    };
    o.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    o.insert("stream".into(), Value::Bool(false));
    o.remove("stream_options");
    o.insert("max_tokens".into(), Value::from(1));
    for k in ["max_completion_tokens", "max_output_tokens"] {
        if o.contains_key(k) {
            o.insert(k.into(), Value::from(1));
        }
    }
    Bytes::from(serde_json::to_vec(&Value::Object(o)).unwrap_or_else(|_| base.to_vec()))
}

/// `body` (a JSON object) with `fields` set at its top level: written in after the opening
/// brace when none of them is in the body yet (no parse of a large prompt), else through a
/// JSON round trip. `None` when the body is not a JSON object.
pub fn with_fields(body: &[u8], fields: &[(&str, Value)]) -> Option<Vec<u8>> {
    let present = fields.iter().any(|(k, _)| {
        let quoted = format!("\"{k}\"");
        memchr::memmem::find(body, quoted.as_bytes()).is_some()
    });
    if present {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let o = v.as_object_mut()?;
        for (k, x) in fields {
            o.insert((*k).to_string(), x.clone());
        }
        return serde_json::to_vec(&v).ok();
    }
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + 64 * fields.len());
    out.extend_from_slice(&body[..=open]);
    for (i, (k, x)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).ok()?;
        out.push(b':');
        serde_json::to_writer(&mut out, x).ok()?;
    }
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_go_in_without_a_parse_and_replace_when_present() {
        let b = br#" {"model":"m","messages":[]}"#;
        let out = with_fields(b, &[("bootstrap_room", json!(7)), ("rid", json!("r"))]).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["bootstrap_room"], 7);
        assert_eq!(v["rid"], "r");
        assert_eq!(v["model"], "m");
        let out = with_fields(b"{}", &[("a", json!(1))]).unwrap();
        assert_eq!(out, br#"{"a":1}"#);
        // Already there: replaced, not duplicated.
        let out = with_fields(br#"{"rid":"client","x":1}"#, &[("rid", json!("gw"))]).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["rid"], "gw");
        assert_eq!(v["x"], 1);
        assert!(with_fields(b"[1]", &[("a", json!(1))]).is_none());
    }

    #[test]
    fn vllm_prefill_asks_one_token_and_remote_decode() {
        let b = br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"messages":[]}"#;
        let v: Value = serde_json::from_slice(&vllm_prefill_body(b)).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
    }

    #[test]
    fn failures_say_whether_to_retry() {
        let f = |s: Option<u16>| Failure {
            status: s,
            message: String::new(),
        };
        assert!(f(None).retryable());
        assert!(f(Some(503)).retryable());
        assert!(f(Some(429)).retryable());
        assert!(!f(Some(400)).retryable());
        assert_eq!(f(Some(400)).gateway_error("p", "id").status(), 400);
        assert_eq!(f(None).gateway_error("p", "id").status(), 502);
        assert!(!f(Some(429)).instance_failed());
    }
}
