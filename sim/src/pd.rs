//! Prefill/decode (PD) disaggregation: an engine-sim plays the prefill or the
//! decode side of SGLang's or vLLM's protocol, and engine-sims hand the KV over
//! to each other over loopback HTTP.
//!
//! **SGLang (Mooncake)** — the router injects `bootstrap_host`, `bootstrap_port`
//! (the prefill's bootstrap server) and a random `bootstrap_room` (u64 below
//! 2^63) into the request and sends the *same* body to a prefill and a decode
//! engine at once; the client gets the decode's response, the prefill's is
//! drained. Here the prefill prefills (through its prefix cache) and produces one
//! token, publishes the room's KV in its [`Registry`], and answers its HTTP
//! request only once a decode has taken the KV (SGLang finishes the prefill
//! request when the transfer succeeded, with `FINISH_LENGTH(0)`), or with a 500
//! after `pd_timeout_ms`. The decode long-polls `POST /sim/pd/rooms/{room}/claim`
//! at `bootstrap_host:bootstrap_port` until the room is published, waits the
//! simulated transfer time, confirms with `POST /sim/pd/rooms/{room}/done`, then
//! decodes without any prefill work. A room is taken by one decode only.
//!
//! **vLLM (NIXL)** — the proxy first sends the prefill the request with
//! `max_tokens: 1`, `stream: false` and `kv_transfer_params.do_remote_decode:
//! true`; the prefill answers at once with a one-token completion whose
//! `kv_transfer_params` names the KV (`remote_engine_id`, `remote_request_id`,
//! `remote_block_ids`, `remote_host`, `remote_port`) and keeps it pinned until a
//! decode read it or `pd_timeout_ms` passed (vLLM: `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
//! The proxy copies those params into the original request for the decode, which
//! reads the KV with `POST /sim/pd/transfers/read` at `remote_host:remote_port`,
//! waits the transfer time, frees it with `POST /sim/pd/transfers/done` and
//! decodes. As in vLLM, a decode request whose params lack a field, or name no
//! blocks (prompt shorter than a block), is simply prefilled locally.
//!
//! An SGLang prefill whose HTTP client goes away while its KV waits for a decode
//! releases the KV at once (SGLang aborts a request whose client disconnected).
//!
//! A decode whose KV does not come within `pd_timeout_ms` (wall clock) fails
//! with a 500 error; the prefill's KV that nobody took is released at the same
//! timeout. The decode checks that the KV is for its prompt (token count and
//! hash) so a wrong room or transfer id never yields an answer.
//!
//! **Abort** (`POST /abort_request`, [`crate::abort`]): a decode waiting for its
//! KV stops waiting and fails with a 500 at once (if it already took the KV, it
//! still confirms the transfer so the prefill releases it); an SGLang prefill
//! holding its KV for a decode fails the room (a decode polling it gets a 410),
//! releases the KV and ends its response with a 500 (or an error event in a
//! stream). A prefill still queued or prefilling is dropped by the scheduler and
//! its room failed the same way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

use crate::abort::AbortRx;
use crate::engine::{Engine, Ev};
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

fn flat_ids(v: Option<&Value>) -> Vec<u64> {
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

/// The KV a prefill hands over.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct KvInfo {
    pub engine_id: String,
    pub prompt_tokens: u32,
    /// Prompt tokens the prefill found in its prefix cache.
    pub cached_tokens: u32,
    /// xxh3 of the rendered prompt: the decode checks the KV is for its prompt.
    pub prompt_hash: u64,
    /// vLLM: the block ids the prefill returned in `remote_block_ids`.
    #[serde(default)]
    pub block_ids: Vec<u64>,
}

#[derive(Clone, Debug)]
enum SlotState {
    /// Not published yet (a decode may already be waiting).
    Pending,
    Published(Arc<KvInfo>),
    /// A decode took the KV and is transferring it.
    Claimed,
    /// The transfer finished; the prefill released the KV.
    Done,
    /// The prefill failed or gave up.
    Failed(String),
}

struct Slot {
    state: watch::Sender<SlotState>,
    created: Instant,
}

impl Slot {
    fn new(state: SlotState) -> Arc<Slot> {
        Arc::new(Slot {
            state: watch::Sender::new(state),
            created: Instant::now(),
        })
    }
}

/// Result of a decode's claim on a room or transfer.
enum Claim {
    Taken(Arc<KvInfo>),
    Pending,
    Refused(String),
    Failed(String),
}

/// Published KV of a prefill engine, keyed by `room:<n>` (SGLang) or
/// `xfer:<remote_request_id>` (vLLM).
pub(crate) struct Registry {
    slots: Mutex<(HashMap<String, Arc<Slot>>, Instant)>,
    gc_after: Duration,
    next_block: AtomicU64,
    next_hold: AtomicU64,
}

impl Registry {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        Registry {
            slots: Mutex::new((HashMap::new(), Instant::now())),
            gc_after: Duration::from_millis(cfg.pd_timeout_ms.saturating_mul(2))
                + Duration::from_secs(60),
            next_block: AtomicU64::new(1),
            next_hold: AtomicU64::new(1),
        }
    }

    pub(crate) fn next_hold(&self) -> u64 {
        self.next_hold.fetch_add(1, Ordering::Relaxed)
    }

    /// `n` fresh block ids (vLLM's `remote_block_ids`).
    pub(crate) fn block_ids(&self, n: usize) -> Vec<u64> {
        let start = self.next_block.fetch_add(n as u64, Ordering::Relaxed);
        (start..start + n as u64).collect()
    }

    /// Drop concluded or never-published slots older than `gc_after` (at most
    /// once a second).
    fn gc(&self, slots: &mut (HashMap<String, Arc<Slot>>, Instant)) {
        let now = Instant::now();
        if now.duration_since(slots.1) < Duration::from_secs(1) {
            return;
        }
        slots.1 = now;
        let gc_after = self.gc_after;
        slots.0.retain(|_, s| {
            now.duration_since(s.created) < gc_after
                || matches!(
                    *s.state.borrow(),
                    SlotState::Published(_) | SlotState::Claimed
                )
        });
    }

    fn slot(&self, key: &str) -> Arc<Slot> {
        let mut slots = self.slots.lock();
        self.gc(&mut slots);
        slots
            .0
            .entry(key.to_string())
            .or_insert_with(|| Slot::new(SlotState::Pending))
            .clone()
    }

    /// Prefill: publish the KV under `key`. A key in flight (published and not
    /// yet transferred) cannot be published again.
    fn publish(&self, key: &str, info: KvInfo) -> Result<Arc<Slot>, String> {
        let mut slots = self.slots.lock();
        self.gc(&mut slots);
        let info = Arc::new(info);
        if let Some(slot) = slots.0.get(key) {
            let mut busy = false;
            let mut reuse = false;
            slot.state.send_if_modified(|s| match s {
                SlotState::Pending => {
                    *s = SlotState::Published(info.clone());
                    reuse = true;
                    true
                }
                SlotState::Published(_) | SlotState::Claimed => {
                    busy = true;
                    false
                }
                SlotState::Done | SlotState::Failed(_) => false,
            });
            if busy {
                return Err(format!("{key} is already in use by another request"));
            }
            if reuse {
                return Ok(slot.clone());
            }
        }
        let slot = Slot::new(SlotState::Published(info));
        slots.0.insert(key.to_string(), slot.clone());
        Ok(slot)
    }

    /// Prefill: mark `key` failed so a decode waiting for it fails now.
    pub(crate) fn fail(&self, key: &str, why: &str) {
        let slot = self.slot(key);
        slot.state.send_if_modified(|s| match s {
            SlotState::Pending | SlotState::Published(_) => {
                *s = SlotState::Failed(why.to_string());
                true
            }
            _ => false,
        });
    }

    /// Decode (through the prefill's HTTP endpoint): wait up to `wait` for the KV,
    /// then take it if `check` accepts it.
    async fn claim(
        &self,
        key: &str,
        wait: Duration,
        check: impl Fn(&KvInfo) -> Result<(), String>,
    ) -> Claim {
        let slot = self.slot(key);
        let mut rx = slot.state.subscribe();
        let _ = tokio::time::timeout(wait, rx.wait_for(|s| !matches!(s, SlotState::Pending))).await;
        let mut out = Claim::Pending;
        slot.state.send_if_modified(|s| match s {
            SlotState::Pending => false,
            SlotState::Published(info) => match check(info) {
                Ok(()) => {
                    out = Claim::Taken(info.clone());
                    *s = SlotState::Claimed;
                    true
                }
                Err(e) => {
                    out = Claim::Refused(e);
                    false
                }
            },
            SlotState::Claimed => {
                out = Claim::Refused(format!("{key} was already taken by another decode request"));
                false
            }
            SlotState::Done => {
                out = Claim::Refused(format!("{key} was already transferred"));
                false
            }
            SlotState::Failed(why) => {
                out = Claim::Failed(why.clone());
                false
            }
        });
        out
    }

    /// Decode: the transfer of `key` finished.
    fn done(&self, key: &str) -> bool {
        let slot = self.slots.lock().0.get(key).cloned();
        slot.is_some_and(|slot| {
            slot.state.send_if_modified(|s| {
                if matches!(s, SlotState::Claimed) {
                    *s = SlotState::Done;
                    true
                } else {
                    false
                }
            })
        })
    }

    /// Prefill: wait until a decode finished taking the KV (true) or `timeout`
    /// passed (false; the slot is failed so a late decode is refused).
    async fn wait_done(slot: &Slot, timeout: Duration) -> bool {
        let mut rx = slot.state.subscribe();
        let _ = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| matches!(s, SlotState::Done | SlotState::Failed(_))),
        )
        .await;
        let mut done = false;
        slot.state.send_if_modified(|s| match s {
            SlotState::Done => {
                done = true;
                false
            }
            SlotState::Failed(_) => false,
            _ => {
                *s = SlotState::Failed("the prefill gave up waiting for a decode engine".into());
                true
            }
        });
        done
    }
}

pub(crate) fn room_key(room: u64) -> String {
    format!("room:{room}")
}

pub(crate) fn transfer_key(id: &str) -> String {
    format!("xfer:{id}")
}

/// A finished prefill to hand over.
pub(crate) struct PrefillJob {
    pub key: String,
    pub hold: u64,
    pub info: KvInfo,
    /// For error messages: `rid=… bootstrap_room=…`.
    pub what: String,
    /// The request's name in abort messages ([`crate::abort::Ticket::name`]).
    pub name: String,
    pub abort: AbortRx,
}

/// Why a room or transfer failed when its prefill was aborted.
const ABORTED: &str = "the prefill request was aborted by POST /abort_request";

/// Prefill side: sit between the scheduler and the HTTP response. Token events
/// pass through; when the prefill finishes, the KV is published and (SGLang) the
/// response is finished only once a decode took it, or failed after the timeout.
/// (vLLM) The response finishes at once and the KV stays pinned meanwhile.
/// An abort ([`crate::abort`]) fails the room at any point before the decode took
/// the KV (SGLang; a vLLM prefill's response is already over then).
pub(crate) fn relay_prefill(
    engine: Arc<Engine>,
    reg: Arc<Registry>,
    cfg: Arc<SimConfig>,
    job: PrefillJob,
    mut from_engine: mpsc::UnboundedReceiver<Ev>,
) -> mpsc::UnboundedReceiver<Ev> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let timeout = Duration::from_millis(cfg.pd_timeout_ms);
        let mut abort = job.abort.clone();
        while let Some(ev) = from_engine.recv().await {
            let usage = match ev {
                Ev::Done(usage) => usage,
                Ev::Aborted => {
                    // the scheduler dropped it (queued or prefilling)
                    reg.fail(&job.key, ABORTED);
                    let _ = tx.send(ev);
                    return;
                }
                ev => {
                    let _ = tx.send(ev);
                    continue;
                }
            };
            let info = KvInfo {
                prompt_tokens: usage.prompt,
                cached_tokens: usage.cached,
                ..job.info
            };
            let slot = match reg.publish(&job.key, info) {
                Ok(slot) => slot,
                Err(why) => {
                    engine.release_hold(job.hold);
                    let _ = tx.send(Ev::Failed {
                        status: 409,
                        message: format!("Prefill failed for request {}: {why}", job.what),
                    });
                    return;
                }
            };
            engine.pd.prefills_published.fetch_add(1, Ordering::Relaxed);
            if cfg.pd_mode == PdMode::Vllm {
                let _ = tx.send(Ev::Done(usage));
            }
            let aborted = async {
                match cfg.pd_mode {
                    PdMode::Sglang => abort.wait().await,
                    PdMode::Vllm => std::future::pending().await,
                }
            };
            let done = tokio::select! {
                done = Registry::wait_done(&slot, timeout) => done,
                () = aborted => {
                    // A decode that already took the KV finishes its transfer.
                    reg.fail(&job.key, ABORTED);
                    engine.release_hold(job.hold);
                    engine.aborted_by_request.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(Ev::Failed {
                        status: 500,
                        message: format!(
                            "Abort request {}: aborted by POST /abort_request while its KV waited for a decode engine ({})",
                            job.name, job.what
                        ),
                    });
                    return;
                }
                // SGLang aborts a request whose HTTP client went away: the KV it held for a
                // decode is released at once rather than at the timeout.
                () = tx.closed(), if cfg.pd_mode == PdMode::Sglang => {
                    reg.fail(&job.key, "the prefill request's client went away");
                    engine.release_hold(job.hold);
                    return;
                }
            };
            engine.release_hold(job.hold);
            let counter = if done {
                &engine.pd.transfers_sent
            } else {
                &engine.pd.transfers_expired
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if cfg.pd_mode == PdMode::Sglang {
                let _ = tx.send(if done {
                    Ev::Done(usage)
                } else {
                    Ev::Failed {
                        status: 500,
                        message: format!(
                            "Prefill transfer failed for request {}: no decode engine took the KV within {:.1}s",
                            job.what,
                            timeout.as_secs_f64()
                        ),
                    }
                });
            }
            return;
        }
        // The engine went away before the prefill finished.
        reg.fail(&job.key, "the prefill request was aborted");
    });
    rx
}

/// Counts a request waiting for its KV while alive.
struct Awaiting<'a>(&'a Engine);

impl<'a> Awaiting<'a> {
    fn new(e: &'a Engine) -> Self {
        e.pd.awaiting_kv.fetch_add(1, Ordering::Relaxed);
        Awaiting(e)
    }
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        self.0.pd.awaiting_kv.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The decode request being served (for matching and error messages).
pub(crate) struct DecodeReq<'a> {
    pub rid: &'a str,
    pub prompt_tokens: u32,
    pub prompt_hash: u64,
    pub arrived: Instant,
}

/// Decode side: get the prompt's KV from the prefill engine named by `plan`,
/// spending the simulated transfer time. `Err` is the message of a 500 error.
/// An abort ends the wait at once.
pub(crate) async fn receive_kv(
    engine: &Engine,
    cfg: &SimConfig,
    plan: &Plan,
    req: DecodeReq<'_>,
    mut abort: AbortRx,
) -> Result<KvInfo, String> {
    let _awaiting = Awaiting::new(engine);
    let deadline = req.arrived + Duration::from_millis(cfg.pd_timeout_ms);
    let (host, port, what, claim_path, claim_body, done_path, done_body) = match plan {
        Plan::SglDecode { host, port, room } => (
            host.as_str(),
            *port,
            format!("rid={} bootstrap_room={room}", req.rid),
            format!("/sim/pd/rooms/{room}/claim"),
            json!({}),
            format!("/sim/pd/rooms/{room}/done"),
            json!({}),
        ),
        Plan::VllmDecode(r) => (
            r.host.as_str(),
            r.port,
            format!(
                "{} (remote_request_id={} remote_engine_id={} at {}:{})",
                req.rid, r.request_id, r.engine_id, r.host, r.port
            ),
            "/sim/pd/transfers/read".to_string(),
            json!({
                "remote_request_id": r.request_id,
                "remote_engine_id": r.engine_id,
                "remote_block_ids": r.block_ids,
            }),
            "/sim/pd/transfers/done".to_string(),
            json!({"remote_request_id": r.request_id}),
        ),
        _ => return Err("not a PD decode request".into()),
    };
    let fail = |counter: &AtomicU64, msg: String| {
        counter.fetch_add(1, Ordering::Relaxed);
        Err(match plan {
            Plan::SglDecode { room, .. } => format!(
                "Decode transfer failed for request {what} with exception \
                 KVTransferError(bootstrap_room={room}): {msg}"
            ),
            _ => format!("KV transfer failed for request {what}: {msg}"),
        })
    };
    let aborted = |what: &str| {
        engine.aborted_by_request.fetch_add(1, Ordering::Relaxed);
        Err(format!(
            "Abort request {}: aborted by POST /abort_request while waiting for its KV ({what})",
            req.rid
        ))
    };
    let claim = async {
        loop {
            let now = Instant::now();
            if now >= deadline {
                let waited = now.duration_since(req.arrived).as_secs_f64();
                let msg = match plan {
                    Plan::SglDecode { room, .. } => {
                        format!(
                            "Request {room} timed out after {waited:.1}s in KVPoll.WaitingForInput"
                        )
                    }
                    _ => format!("the KV did not arrive within {waited:.1}s"),
                };
                return fail(&engine.pd.transfer_timeouts, msg);
            }
            let wait = (deadline - now).min(Duration::from_secs(2));
            let path = format!("{claim_path}?wait_ms={}", wait.as_millis());
            match post(
                host,
                port,
                &path,
                &claim_body,
                wait + Duration::from_secs(2),
            )
            .await
            {
                Ok((200, body)) => match serde_json::from_slice::<KvInfo>(&body) {
                    Ok(info) => break Ok(info),
                    Err(e) => return fail(&engine.pd.transfer_errors, format!("bad KV info: {e}")),
                },
                // not published yet: the prefill already waited `wait`
                Ok((404, body)) if is_pending(&body) => {}
                Ok((status, body)) => {
                    let why = serde_json::from_slice::<Value>(&body)
                        .ok()
                        .and_then(|v| v["error"].as_str().map(str::to_string))
                        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
                    return fail(
                        &engine.pd.transfer_errors,
                        format!("the prefill engine refused the transfer ({status}): {why}"),
                    );
                }
                // the prefill is not reachable (yet): retry until the deadline
                Err(_) => {
                    let pause = Duration::from_millis(20)
                        .min(deadline.saturating_duration_since(Instant::now()));
                    tokio::time::sleep(pause).await;
                }
            }
        }
    };
    let info = tokio::select! {
        r = claim => r?,
        () = abort.wait() => return aborted(&what),
    };
    let matches = info.prompt_tokens == req.prompt_tokens && info.prompt_hash == req.prompt_hash;
    let mut was_aborted = false;
    if matches {
        let ms =
            cfg.kv_transfer_ms_per_1k_tokens * info.prompt_tokens as f64 / 1000.0 / cfg.time_scale;
        let transfer = tokio::time::sleep(Duration::from_secs_f64(ms.max(0.0) / 1000.0));
        tokio::select! {
            () = transfer => {}
            () = abort.wait() => was_aborted = true,
        }
    }
    // Free the prefill's KV either way.
    let _ = post(host, port, &done_path, &done_body, Duration::from_secs(5)).await;
    if was_aborted {
        return aborted(&what);
    }
    if !matches {
        return fail(
            &engine.pd.transfer_errors,
            format!(
                "the KV is for another prompt ({} tokens, hash {:016x}; this request has {} tokens, hash {:016x})",
                info.prompt_tokens, info.prompt_hash, req.prompt_tokens, req.prompt_hash
            ),
        );
    }
    engine.pd.transfers_received.fetch_add(1, Ordering::Relaxed);
    Ok(info)
}

fn is_pending(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok_and(|v| v["status"] == "pending")
}

/// `POST http://host:port{path}` with a JSON body over a fresh HTTP/1.1
/// connection; (status, body).
async fn post(
    host: &str,
    port: u16,
    path: &str,
    body: &Value,
    timeout: Duration,
) -> Result<(u16, Bytes), String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let call = async {
        let stream = TcpStream::connect(authority.as_str())
            .await
            .map_err(|e| format!("connect {authority}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake {authority}: {e}"))?;
        let conn = crate::task::AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        let req = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header::HOST, authority.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("POST {authority}{path}: {e}"))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading {authority}{path}: {e}"))?
            .to_bytes();
        drop(conn);
        Ok((status, bytes))
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| format!("POST {authority}{path}: timed out"))?
}

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
