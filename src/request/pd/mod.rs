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
use crate::load::Outcome;
use crate::runtime::Instance;
use crate::shared::Shared;
use bytes::Bytes;
use log::warn;
use pingora::proxy::Session;
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;

mod prefill;
pub(super) mod side;
#[cfg(test)]
mod tests;

pub use prefill::with_fields;
pub use side::{Attempt, Failure, Side, State};

/// Waits (briefly) for the prefill's outcome after the decode answered `status`: a decode
/// error is often the consequence of a failed prefill, which is then the one to blame.
pub async fn settle_after_decode_error(ctx: &Ctx, status: u16) {
    if status < 400 {
        return;
    }
    if let Some(a) = ctx.pd.as_ref() {
        if a.mode == PdMode::SglangMooncake && a.side.running() {
            a.side.settled(side::SETTLE).await;
        }
    }
}

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
    let http = match ctx.main_leg().and_then(|l| l.local()) {
        Some(l) => l.service.http.clone(),
        None => shared.pd_http.clone(),
    };
    let leg = Ready {
        url: prefill.url(&path),
        // The body both sides start from: the client's (its model rewritten), kept for
        // retries.
        base: ctx.upstream_body().cloned().unwrap_or_default(),
        side,
        prefill,
        decode,
        http,
        headers,
        started: now,
    };
    match mode {
        PdMode::SglangMooncake => {
            send_sglang(ctx, plan, leg);
            Ok(())
        }
        PdMode::VllmNixl => send_vllm(ctx, plan, leg).await,
    }
}

/// A prefill leg ready to be sent: what both protocols start from.
struct Ready {
    side: Arc<Side>,
    prefill: Arc<Instance>,
    decode: Arc<Instance>,
    http: reqwest::Client,
    url: String,
    headers: reqwest::header::HeaderMap,
    base: Bytes,
    /// When the leg was dispatched.
    started: Instant,
}

/// SGLang: the bootstrap fields and the request id into the body both engines get; the
/// prefill sent by a task of its own, the decode by Pingora once this returns.
fn send_sglang(ctx: &mut Ctx, plan: &Plan, leg: Ready) {
    let Ready {
        side,
        prefill,
        decode,
        http,
        url,
        headers,
        base,
        started: _,
    } = leg;
    let t = &plan.runtime.timeouts;
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
    let task = tokio::spawn(prefill::sglang_prefill(
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
        mode: PdMode::SglangMooncake,
        side,
        rid: Some(rid),
        room: Some(room),
        prefill,
        decode,
        task: Some(task),
        http,
    });
}

/// vLLM: the prefill first (one token); its `kv_transfer_params` into the decode's body.
async fn send_vllm(ctx: &mut Ctx, plan: &Plan, leg: Ready) -> Result<(), Failure> {
    let Ready {
        side,
        prefill,
        decode,
        http,
        url,
        headers,
        base,
        started,
    } = leg;
    let body = prefill::vllm_prefill_body(&base);
    let first_byte = plan.runtime.timeouts.first_byte;
    let r = prefill::vllm_prefill(&http, &url, headers, body, first_byte).await;
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
        mode: PdMode::VllmNixl,
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
