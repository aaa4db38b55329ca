//! What a response is made of: a full body or the SSE stream fed by the scheduler, the
//! error that drops the connection, and the small JSON responses.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::abort::Ticket;
use crate::api::{self, Api, Meta, StreamFmt};
use crate::engine::Ev;
use crate::Faults;

/// Error that makes hyper drop the connection without (the rest of) a response.
#[derive(Debug)]
pub(crate) struct Abort(pub String);

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Abort {}

pub(super) fn abort(msg: impl Into<String>) -> Abort {
    Abort(msg.into())
}

pub(super) type BoxError = Abort;

/// Response body: a full buffer or an SSE stream fed by the scheduler.
pub(crate) enum SimBody {
    Full(Option<Bytes>),
    Sse(Box<SseBody>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SseState {
    Streaming,
    /// The close_after_chunks limit was reached: yield once so hyper
    /// flushes what was sent, then fail the body (hyper drops the connection).
    AbortPending,
    Abort,
    Finished,
}

pub(crate) struct SseBody {
    /// Registered while the stream lives. Declared before `rx` so it is dropped
    /// first: once the scheduler sees the stream gone, the request is
    /// unregistered.
    ticket: Ticket,
    rx: mpsc::UnboundedReceiver<Ev>,
    fmt: StreamFmt,
    close_after: Option<u64>,
    state: SseState,
    pending: Option<String>,
}

impl SseBody {
    fn handle(&mut self, ev: Ev, out: &mut String) {
        match ev {
            Ev::Admitted { cached } => self.fmt.admitted(out, cached),
            Ev::Tokens { upto } => self.fmt.tokens(out, upto),
            Ev::Done(u) => self.fmt.done(out, &u),
            Ev::Failed { status, message } => self.fmt.failed(out, status, &message),
            Ev::Aborted => self.fmt.aborted(out, &self.ticket.message()),
        }
    }

    fn limit_reached(&self) -> bool {
        self.close_after.is_some_and(|n| self.fmt.chunks >= n)
    }
}

/// A streamed answer's body: the engine's events as server-sent events.
pub(super) fn sse_body(
    meta: Meta,
    prompt_tokens: usize,
    ticket: Ticket,
    rx: mpsc::UnboundedReceiver<Ev>,
    faults: &Faults,
) -> SseBody {
    let mut fmt = StreamFmt::new(meta, prompt_tokens as u32);
    let mut start = String::new();
    fmt.start(&mut start);
    SseBody {
        ticket,
        rx,
        fmt,
        close_after: faults.close_after_chunks,
        state: SseState::Streaming,
        pending: (!start.is_empty()).then_some(start),
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Sse(s) => {
                let s = &mut **s;
                loop {
                    match s.state {
                        SseState::Finished => {
                            return Poll::Ready(s.pending.take().map(|p| Ok(Frame::data(p.into()))))
                        }
                        SseState::Abort => {
                            return Poll::Ready(Some(Err(abort(
                                "engine-sim: close_after_chunks fault",
                            ))))
                        }
                        SseState::AbortPending => {
                            if let Some(p) = s.pending.take() {
                                return Poll::Ready(Some(Ok(Frame::data(p.into()))));
                            }
                            s.state = SseState::Abort;
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                        SseState::Streaming => {}
                    }
                    if s.limit_reached() {
                        s.state = SseState::AbortPending;
                        continue;
                    }
                    let mut out = s.pending.take().unwrap_or_default();
                    let mut closed = false;
                    while out.len() < 32 * 1024 {
                        match s.rx.poll_recv(cx) {
                            Poll::Ready(Some(ev)) => {
                                s.handle(ev, &mut out);
                                if s.fmt.finished {
                                    s.state = SseState::Finished;
                                    break;
                                }
                                if s.limit_reached() {
                                    s.state = SseState::AbortPending;
                                    break;
                                }
                            }
                            Poll::Ready(None) => {
                                closed = true;
                                break;
                            }
                            Poll::Pending => break,
                        }
                    }
                    if closed {
                        // engine went away without finishing
                        s.state = SseState::AbortPending;
                    }
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out.into()))));
                    }
                    if s.state == SseState::Streaming {
                        return Poll::Pending;
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Sse(_) => SizeHint::default(),
        }
    }
}

pub(super) fn json_response(status: StatusCode, v: &Value) -> Response<SimBody> {
    let mut r = Response::new(SimBody::Full(Some(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub(super) fn error_response(api: Option<Api>, status: u16, msg: &str) -> Response<SimBody> {
    json_response(
        StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
        &api::error_body(api, status, msg),
    )
}

pub(super) fn not_found() -> Response<SimBody> {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

pub(super) async fn read_body(req: Request<Incoming>) -> Result<Bytes, BoxError> {
    match req.into_body().collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(abort(format!("reading request body: {e}"))),
    }
}
