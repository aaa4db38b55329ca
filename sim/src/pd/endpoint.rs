//! The prefill's HTTP endpoints under `/sim/pd/`: claiming a room or reading a transfer,
//! and confirming it.

use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::{json, Value};

use crate::{PdMode, Role, SimConfig};

use super::plan::flat_ids;
use super::registry::{room_key, transfer_key, Claim, Registry};

fn wait_ms(query: Option<&str>) -> Duration {
    let ms = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| kv.strip_prefix("wait_ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Duration::from_millis(ms.min(10_000))
}

fn refusal(status: StatusCode, msg: &str) -> (StatusCode, Value) {
    (status, json!({"error": msg}))
}

/// The prefill's endpoints under `/sim/pd/` (and `/health` on the bootstrap
/// port). `rest` is the path after `/sim/pd/`.
pub(crate) async fn endpoint(
    cfg: &SimConfig,
    reg: &Registry,
    method: &Method,
    rest: &str,
    query: Option<&str>,
    body: &[u8],
) -> (StatusCode, Value) {
    if *method != Method::POST {
        return refusal(StatusCode::METHOD_NOT_ALLOWED, "use POST");
    }
    let wait = wait_ms(query);
    let claim = |c: Claim| match c {
        Claim::Taken(info) => (StatusCode::OK, json!(*info)),
        Claim::Pending => (StatusCode::NOT_FOUND, json!({"status": "pending"})),
        Claim::Refused(why) => refusal(StatusCode::CONFLICT, &why),
        Claim::Failed(why) => refusal(StatusCode::GONE, &why),
    };
    let not_prefill = |mode: &str| {
        refusal(
            StatusCode::NOT_FOUND,
            &format!(
                "engine-sim {} is not a {mode} prefill engine (role {}, pd mode {})",
                cfg.id,
                cfg.role.as_str(),
                cfg.pd_mode.as_str()
            ),
        )
    };
    let is_prefill = cfg.role == Role::Prefill;
    if let Some(room) = rest.strip_prefix("rooms/") {
        if !(is_prefill && cfg.pd_mode == PdMode::Sglang) {
            return not_prefill("sglang");
        }
        let (room, action) = room.split_once('/').unwrap_or((room, ""));
        let Ok(room) = room.parse::<u64>() else {
            return refusal(StatusCode::BAD_REQUEST, "bad room");
        };
        let key = room_key(room);
        return match action {
            "claim" => claim(reg.claim(&key, wait, |_| Ok(())).await),
            "done" if reg.done(&key) => (StatusCode::OK, json!({"status": "done"})),
            "done" => refusal(
                StatusCode::CONFLICT,
                "no transfer in progress for this room",
            ),
            _ => refusal(StatusCode::NOT_FOUND, "unknown room action"),
        };
    }
    if let Some(action) = rest.strip_prefix("transfers/") {
        if !(is_prefill && cfg.pd_mode == PdMode::Vllm) {
            return not_prefill("vllm");
        }
        let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let Some(id) = body.get("remote_request_id").and_then(Value::as_str) else {
            return refusal(StatusCode::BAD_REQUEST, "remote_request_id is required");
        };
        let key = transfer_key(id);
        return match action {
            "read" => {
                let engine_id = body.get("remote_engine_id").and_then(Value::as_str);
                if engine_id != Some(cfg.id.as_str()) {
                    return refusal(
                        StatusCode::CONFLICT,
                        &format!(
                            "remote_engine_id {engine_id:?} is not this engine ({})",
                            cfg.id
                        ),
                    );
                }
                let blocks = flat_ids(body.get("remote_block_ids"));
                claim(
                    reg.claim(&key, wait, |info| {
                        if info.block_ids == blocks {
                            Ok(())
                        } else {
                            Err(format!(
                                "remote_block_ids do not match the blocks of {id} ({} blocks)",
                                info.block_ids.len()
                            ))
                        }
                    })
                    .await,
                )
            }
            "done" if reg.done(&key) => (StatusCode::OK, json!({"status": "done"})),
            "done" => refusal(StatusCode::CONFLICT, "no transfer in progress for this id"),
            _ => refusal(StatusCode::NOT_FOUND, "unknown transfer action"),
        };
    }
    refusal(StatusCode::NOT_FOUND, "unknown PD endpoint")
}
