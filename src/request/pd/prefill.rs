//! The prefill requests themselves: SGLang's (sent beside the decode, read to its end)
//! and vLLM's (one token, its `kv_transfer_params` for the decode), their bodies and
//! errors.

use crate::load::Outcome;
use crate::runtime::Instance;
use crate::usage::{JsonCollector, SseScanner, Usage};
use bytes::Bytes;
use log::warn;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::side::{abort, Failure, Side, State};

/// Largest error body read from a failed prefill (for the message).
const MAX_ERROR_BODY: usize = 16 * 1024;

/// SGLang's prefill: sent beside the decode, read to its end. A failure tells the decode
/// to abort.
#[allow(clippy::too_many_arguments)]
pub(super) async fn sglang_prefill(
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
pub(super) async fn vllm_prefill(
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
pub(super) fn vllm_prefill_body(base: &[u8]) -> Bytes {
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
