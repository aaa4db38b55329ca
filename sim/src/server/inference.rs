//! One inference request: parsed, refused or admitted, its KV received (PD decode),
//! submitted to the scheduler, and answered streamed or whole.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{header, HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::abort::Ticket;
use crate::api::{self, Api, Meta};
use crate::decision;
use crate::engine::{Ev, Submit, Usage};
use crate::kvcache::{block_hashes_at, token_count_at};
use crate::pd::{self, DecodeReq, KvInfo, Plan, PrefillJob};
use crate::{Faults, SimConfig};

use super::body::{
    abort, error_response, json_response, read_body, sse_body, BoxError, SimBody, SseBody,
};
use super::state::{unix_now, Shared};

pub(super) async fn inference(
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
    if let Some(r) = too_long(shared, api, &plan, prompt_tokens, output_tokens) {
        return Ok(r);
    }
    let hashes = block_hashes_at(&parsed.prompt, cfg.block_size, cfg.bytes_per_token);
    let prompt_hash = xxhash_rust::xxh3::xxh3_64(&parsed.prompt);
    let seed = hashes.first().copied().unwrap_or(prompt_hash);
    let (tag, id) = response_id(shared, api);
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

/// A prompt and output over the context length or the KV cache: a 400, and (SGLang) the room
/// failed for the decode waiting on it.
fn too_long(
    shared: &Shared,
    api: Api,
    plan: &Plan,
    prompt_tokens: usize,
    output_tokens: usize,
) -> Option<Response<SimBody>> {
    let cfg = &shared.cfg;
    if prompt_tokens + output_tokens <= cfg.max_model_len
        && shared.engine.blocks_needed(prompt_tokens, output_tokens) <= cfg.kv_blocks
    {
        return None;
    }
    if let Plan::SglPrefill { room } = plan {
        // the decode waiting for this room fails now
        shared
            .pd
            .fail(&pd::room_key(*room), "the prefill rejected the request");
    }
    Some(error_response(
        Some(api),
        400,
        &format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
            cfg.max_model_len.min(cfg.kv_blocks * cfg.block_size),
            prompt_tokens + output_tokens,
            prompt_tokens,
            output_tokens
        ),
    ))
}

/// A response's tag (this engine and a counter, in hex) and its id in the API's shape.
fn response_id(shared: &Shared, api: Api) -> (String, String) {
    let n = shared.ids.fetch_add(1, Ordering::Relaxed);
    let tag = format!(
        "{:08x}{n:08x}",
        xxhash_rust::xxh3::xxh3_64(shared.cfg.id.as_bytes()) as u32
    );
    let id = match api {
        Api::Chat => format!("chatcmpl-{tag}"),
        Api::Completions => format!("cmpl-{tag}"),
        Api::Responses => format!("resp_{tag}"),
        Api::Messages => format!("msg_{tag}"),
    };
    (tag, id)
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
