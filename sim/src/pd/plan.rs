//! What the PD protocol asks of one request: the PD fields of its body and the [`Plan`]
//! they make for this engine's role and mode.

use serde_json::Value;

use crate::{PdMode, Role, SimConfig};

/// The PD fields of a request body, as sent.
#[derive(Debug, Default)]
pub(crate) struct PdFields {
    pub bootstrap_host: Option<Value>,
    pub bootstrap_port: Option<Value>,
    pub bootstrap_room: Option<Value>,
    pub kv_transfer_params: Option<Value>,
}

impl PdFields {
    pub(crate) fn from_body(body: &Value) -> Self {
        let get = |k: &str| body.get(k).filter(|v| !v.is_null()).cloned();
        PdFields {
            bootstrap_host: get("bootstrap_host"),
            bootstrap_port: get("bootstrap_port"),
            bootstrap_room: get("bootstrap_room"),
            kv_transfer_params: get("kv_transfer_params"),
        }
    }
}

/// Where a vLLM decode reads its KV (the prefill's `kv_transfer_params`).
#[derive(Clone, Debug)]
pub(crate) struct VllmRemote {
    pub engine_id: String,
    pub request_id: String,
    pub host: String,
    pub port: u16,
    pub block_ids: Vec<u64>,
}

/// What the PD protocol asks of one request.
#[derive(Clone, Debug)]
pub(crate) enum Plan {
    /// Serve it like an integrated engine.
    Local,
    SglPrefill {
        room: u64,
    },
    SglDecode {
        host: String,
        port: u16,
        room: u64,
    },
    VllmPrefill,
    VllmDecode(VllmRemote),
}

impl Plan {
    pub(crate) fn is_prefill(&self) -> bool {
        matches!(self, Plan::SglPrefill { .. } | Plan::VllmPrefill)
    }
}

const NO_ROOM: &str = "Disaggregated request received without bootstrap room id";

fn room_of(v: &Option<Value>) -> Result<u64, String> {
    match v {
        None => Err(NO_ROOM.into()),
        Some(Value::Array(_)) => {
            Err("engine-sim does not support batched requests (bootstrap_room arrays)".into())
        }
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("bootstrap_room must be a non-negative integer, got {v}")),
    }
}

pub(super) fn flat_ids(v: Option<&Value>) -> Vec<u64> {
    // vLLM sends a flat list, newer versions one list per KV-cache group.
    let mut out = Vec::new();
    for x in v.and_then(Value::as_array).into_iter().flatten() {
        match x {
            Value::Array(inner) => out.extend(inner.iter().filter_map(Value::as_u64)),
            other => out.extend(other.as_u64()),
        }
    }
    out
}

/// Decide what the request is, from the engine's role and the request's PD fields.
pub(crate) fn plan(cfg: &SimConfig, f: &PdFields) -> Result<Plan, String> {
    match (cfg.role, cfg.pd_mode) {
        (Role::Integrated, _) => Ok(Plan::Local),
        (Role::Prefill, PdMode::Sglang) => Ok(Plan::SglPrefill {
            room: room_of(&f.bootstrap_room)?,
        }),
        (Role::Decode, PdMode::Sglang) => {
            let room = room_of(&f.bootstrap_room)?;
            let host = f
                .bootstrap_host
                .as_ref()
                .and_then(Value::as_str)
                .ok_or("Disaggregated request received without bootstrap_host")?
                .to_string();
            let port = f
                .bootstrap_port
                .as_ref()
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or(
                    "Disaggregated request received without bootstrap_port (engine-sim needs \
                     the prefill's bootstrap port or its main port)",
                )?;
            Ok(Plan::SglDecode { host, port, room })
        }
        (Role::Prefill, PdMode::Vllm) => {
            let remote_decode = f
                .kv_transfer_params
                .as_ref()
                .and_then(|p| p.get("do_remote_decode"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            Ok(if remote_decode {
                Plan::VllmPrefill
            } else {
                Plan::Local
            })
        }
        (Role::Decode, PdMode::Vllm) => {
            let Some(p) = &f.kv_transfer_params else {
                return Ok(Plan::Local);
            };
            if p.get("do_remote_prefill").and_then(Value::as_bool) != Some(true) {
                return Ok(Plan::Local);
            }
            let s = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_string);
            let port = p
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok());
            let block_ids = flat_ids(p.get("remote_block_ids"));
            match (
                s("remote_engine_id"),
                s("remote_request_id"),
                s("remote_host"),
                port,
            ) {
                (Some(engine_id), Some(request_id), Some(host), Some(port))
                    if !block_ids.is_empty() =>
                {
                    Ok(Plan::VllmDecode(VllmRemote {
                        engine_id,
                        request_id,
                        host,
                        port,
                        block_ids,
                    }))
                }
                // vLLM: "Got invalid KVTransferParams … will not utilize KVTransfer"
                // (or no blocks to pull): the decode prefills the prompt itself.
                _ => Ok(Plan::Local),
            }
        }
    }
}
