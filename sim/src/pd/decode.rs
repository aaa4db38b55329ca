//! The decode side: getting a prompt's KV from the prefill engine over loopback HTTP,
//! spending the simulated transfer time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::net::TcpStream;

use crate::abort::AbortRx;
use crate::engine::Engine;
use crate::SimConfig;

use super::plan::Plan;
use super::registry::KvInfo;

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
