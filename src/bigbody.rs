//! Request bodies larger than Pingora's 64 KiB retry buffer.
//!
//! Pingora 0.9 replays a body read in `request_filter` from its retry buffer, which keeps at
//! most 64 KiB; above that it forwards the request headers and never the body, and the
//! engine waits forever. LLM prompts are often 100 KB to 1 MB. Instead of patching Pingora,
//! the main request (which has admitted the request, read and parsed the whole body, and
//! planned it: destination, decision, the picked leg with its load guard) runs the normal
//! proxy pipeline as a *subrequest* (Pingora's subrequest API) and feeds it the body from
//! memory. The subrequest receives the plan and its legs in a [`Handoff`] and runs the same
//! dispatch and complete phases ([`crate::request`]) as a small request would; the main
//! request only pipes the subrequest's response tasks to the client.
//!
//! The subrequest session itself carries *no* body (`BodyMode::NoBody`: Pingora sees an
//! empty request). The body travels in the [`Handoff`] and our `request_body_filter` emits it
//! at the end of the (empty) request body of *every* upstream attempt. Feeding it through
//! the subrequest's channel instead would let Pingora read it once: a retry to another
//! instance (a 503 or 429 from the engine) would find its 64 KiB retry buffer truncated and
//! send the headers without the body. The client's `Content-Type`, which Pingora strips
//! from a body-less subrequest, is put back from the handoff.
//!
//! This is our own pipe rather than `pingora_proxy::subrequest::pipe::pipe_subrequest`:
//! with a preset body that function never polls the client, so a client that hangs up is
//! not noticed and the engine keeps generating. Here the client connection is watched
//! throughout; when it closes, the subrequest's channels are dropped, its next write fails
//! and it ends through its normal error path (its load guard is released, its `logging`
//! runs).

use crate::error::GatewayError;
use crate::request::{respond, Handoff};
use futures_util::FutureExt;
use log::{debug, warn};
use pingora::prelude::*;
use pingora::protocols::http::HttpTask;
use pingora::proxy::subrequest::{BodyMode, Ctx as SubrequestCtx};
use pingora::proxy::Session;
use std::time::Duration;

/// How long a subrequest may run after its client left before it is aborted.
const ABANDON_GRACE: Duration = Duration::from_secs(5);

/// Runs the request as a subrequest with `handoff.body` and pipes its response to the client.
pub async fn run(session: &mut Session, handoff: Handoff) -> Result<()> {
    let anthropic = handoff.plan.api.is_anthropic();
    let request_id = handoff.plan.request_id.clone();
    let Some(spawner) = session.subrequest_spawner.as_ref() else {
        return Err(Error::explain(
            InternalError,
            "subrequests are not enabled on this session",
        ));
    };
    let sctx = SubrequestCtx::builder()
        .body_mode(BodyMode::NoBody)
        .user_ctx(Box::new(Some(handoff)))
        .build();
    let (prepared, handle) = spawner.create_subrequest(session.as_downstream(), sctx);
    let pingora::protocols::http::subrequest::server::SubrequestHandle {
        tx,
        mut rx,
        subreq_wants_body: _,
        mut subreq_proxy_error,
    } = handle;
    // Nothing is sent on `tx` (the body comes from the handoff), but it stays open while the
    // subrequest runs: closing it reads as the client leaving.
    let join = tokio::spawn(prepared.run());

    let mut header_sent = false;
    let mut response_done = false;
    let mut client_gone = false;
    let mut proxy_error: Option<Box<Error>> = None;
    let mut proxy_error_closed = false;
    while !response_done {
        tokio::select! {
            task = rx.recv() => {
                let Some(t) = task else { break };
                let mut tasks = vec![t];
                while let Some(Some(t)) = tokio::task::unconstrained(rx.recv()).now_or_never() {
                    tasks.push(t);
                }
                if tasks.iter().any(|t| matches!(t, HttpTask::Header(..))) {
                    header_sent = true;
                }
                match session.write_response_tasks(tasks).await {
                    Ok(done) => response_done = done,
                    Err(e) => {
                        debug!("request {request_id}: client write failed: {e}");
                        client_gone = true;
                        break;
                    }
                }
            }
            r = session.downstream_session.read_body_or_idle(true), if !client_gone => {
                match r {
                    Err(e) => {
                        debug!("request {request_id}: client left while streaming: {e}");
                        client_gone = true;
                        break;
                    }
                    Ok(_) => {
                        // Unexpected bytes after the body (pipelining): stop watching.
                        client_gone = false;
                    }
                }
            }
            e = &mut subreq_proxy_error, if !proxy_error_closed => {
                match e {
                    Ok(e) => proxy_error = Some(e),
                    Err(_) => proxy_error_closed = true,
                }
            }
        }
    }
    if client_gone {
        // Closing both channels makes the subrequest's next read or write fail.
        drop(rx);
        drop(tx);
        let abort = join.abort_handle();
        if tokio::time::timeout(ABANDON_GRACE, join).await.is_err() {
            warn!("request {request_id}: subrequest still running {ABANDON_GRACE:?} after the client left; aborting it");
            abort.abort();
        }
        return Err(Error::explain(ConnectionClosed, "client closed the connection").into_down());
    }
    // Drain what the subrequest still sends (its final Done) before joining it.
    while rx.recv().await.is_some() {}
    drop(tx);
    let _ = join.await;
    if !header_sent {
        // The subrequest ended without answering (it answers its own errors normally).
        // The detail (addresses, OS errors) goes to the log, not to the client.
        if let Some(e) = &proxy_error {
            log::warn!("request {request_id}: the subrequest failed without answering: {e}");
        }
        let e = GatewayError::BadGateway(format!(
            "the upstream failed before answering (request id {request_id}: details in the gateway's log)"
        ));
        respond(
            session,
            e.status(),
            "application/json",
            e.body(anthropic),
            &request_id,
        )
        .await?;
    } else if !response_done {
        return Err(Error::explain(
            ConnectionClosed,
            "subrequest ended before its response was complete",
        ));
    }
    Ok(())
}
