//! The routes: inference paths, the PD endpoints, `/admin/`, SGLang's
//! `POST /abort_request` and the engines' info endpoints.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};

use crate::abort::Target;
use crate::api::Api;
use crate::pd::{self};
use crate::{Faults, Role};

use super::body::{abort, error_response, json_response, not_found, read_body, BoxError, SimBody};
use super::inference::inference;
use super::state::Shared;

fn is_inference(path: &str) -> Option<Api> {
    match path {
        "/v1/chat/completions" => Some(Api::Chat),
        "/v1/completions" => Some(Api::Completions),
        "/v1/responses" => Some(Api::Responses),
        "/v1/messages" => Some(Api::Messages),
        _ => None,
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

pub(super) async fn handle(
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
