//! The prefill leg's state, shared by the request and the task that reads the prefill's
//! response: how it failed ([`Failure`]), its progress ([`State`]), its load guard
//! ([`Side`]), the current attempt's pair ([`Attempt`]) and the SGLang abort call.

use crate::config::PdMode;
use crate::error::GatewayError;
use crate::load::{LoadGuard, Outcome};
use crate::runtime::Instance;
use crate::usage::Usage;
use log::debug;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokengate_plugins::InstanceKey;
use tokio::sync::watch;

/// How long an abort call to an engine may take.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);
/// A decode that failed while its prefill still runs: how long to wait for the prefill's
/// own outcome before blaming the decode (the decode's error is often the prefill's).
pub(super) const SETTLE: Duration = Duration::from_millis(200);

/// Why a prefill failed.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The prefill's status, when it answered one.
    pub status: Option<u16>,
    pub message: String,
}

impl Failure {
    /// Another pair may do better: no answer, a timeout, overload or a server error. A 4xx
    /// says the request itself is wrong.
    pub fn retryable(&self) -> bool {
        self.status.is_none_or(|s| s >= 500 || s == 408 || s == 429)
    }

    /// The prefill instance is to blame (passive health): no answer or a 5xx.
    pub(super) fn instance_failed(&self) -> bool {
        self.status.is_none_or(|s| s >= 500)
    }

    /// The error the client gets when no retry is left (or the request is bad).
    /// A bad request says the engine's message; any other failure says what failed and
    /// leaves the detail (addresses, OS errors) to the log line, with the request id.
    pub fn gateway_error(&self, prefill: &str, request_id: &str) -> GatewayError {
        if self
            .status
            .is_some_and(|s| (400..500).contains(&s) && !self.retryable())
        {
            return GatewayError::BadRequest(format!(
                "prefill instance {prefill} failed: {}",
                self.message
            ));
        }
        log::warn!(
            "request {request_id}: prefill instance {prefill} failed: {}",
            self.message
        );
        let msg = match self.status {
            Some(s) => format!(
                "prefill instance {prefill} answered {s} (request id {request_id}: details in the gateway's log)"
            ),
            None => format!(
                "prefill instance {prefill} failed (request id {request_id}: details in the gateway's log)"
            ),
        };
        match self.status {
            Some(503) | Some(429) => GatewayError::Unavailable(msg),
            _ => GatewayError::BadGateway(msg),
        }
    }
}

/// The prefill's progress, as the dispatch and completion phases read it.
#[derive(Debug, Clone, Default)]
pub enum State {
    #[default]
    Running,
    /// The prefill's response ended well: its usage and how long it took.
    Done {
        usage: Usage,
        ms: f64,
    },
    Failed(Failure),
    /// The gateway gave up on it (the decode failed, the client left).
    Aborted,
}

/// The prefill leg's shared half: its load guard (released by whoever ends the prefill:
/// the task that reads its response, or the request when it gives up on it) and its state.
pub struct Side {
    guard: Mutex<Option<LoadGuard<Instance>>>,
    state: watch::Sender<State>,
    pub(super) instance: Arc<Instance>,
    counter: prometheus::IntCounterVec,
}

impl std::fmt::Debug for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side")
            .field("instance", &self.instance.id)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl Side {
    pub(super) fn new(guard: LoadGuard<Instance>, counter: prometheus::IntCounterVec) -> Arc<Side> {
        let instance = guard.instance().clone();
        Arc::new(Side {
            guard: Mutex::new(Some(guard)),
            state: watch::Sender::new(State::Running),
            instance,
            counter,
        })
    }

    pub fn state(&self) -> State {
        self.state.borrow().clone()
    }

    pub fn failure(&self) -> Option<Failure> {
        match &*self.state.borrow() {
            State::Failed(f) => Some(f.clone()),
            _ => None,
        }
    }

    pub fn running(&self) -> bool {
        matches!(*self.state.borrow(), State::Running)
    }

    /// The prefill phase ended (its first token is the decode's business).
    pub fn first_token(&self) {
        if let Some(g) = self.guard.lock().as_mut() {
            g.first_token();
        }
    }

    /// Releases the prefill's load with `o` (once; later calls do nothing).
    pub fn finish(&self, o: Outcome) {
        let g = self.guard.lock().take();
        if let Some(mut g) = g {
            g.first_token();
            g.finish(o);
        }
    }

    /// Sets the final state (the first one wins) and counts it.
    pub(super) fn settle(&self, s: State) -> bool {
        let label = match &s {
            State::Running => return false,
            State::Done { .. } => "ok",
            State::Failed(_) => "error",
            State::Aborted => "aborted",
        };
        let set = self.state.send_if_modified(|cur| {
            if matches!(cur, State::Running) {
                *cur = s;
                true
            } else {
                false
            }
        });
        if set {
            self.counter
                .with_label_values(&[self.instance.id.as_str(), label])
                .inc();
        }
        set
    }

    /// Waits until the prefill is no longer running, at most `d`.
    pub(super) async fn settled(&self, d: Duration) {
        let mut rx = self.state.subscribe();
        let _ = tokio::time::timeout(d, rx.wait_for(|s| !matches!(s, State::Running))).await;
    }
}

/// The current attempt's pair.
pub struct Attempt {
    pub mode: PdMode,
    pub side: Arc<Side>,
    /// SGLang: the request id both engines know the request by (their abort key).
    pub rid: Option<String>,
    pub room: Option<u64>,
    pub prefill: Arc<Instance>,
    pub decode: Arc<Instance>,
    pub(super) task: Option<tokio::task::JoinHandle<()>>,
    pub(super) http: reqwest::Client,
}

impl Attempt {
    /// Gives up on a prefill that still runs: the engine is told to abort (SGLang) and the
    /// task reading its response is stopped (closing the connection, which engines also
    /// take as an abort); its load is released as cancelled.
    pub fn abort_prefill(&mut self) {
        if self.side.settle(State::Aborted) {
            if let Some(rid) = &self.rid {
                abort(&self.http, &self.prefill, rid);
            }
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.side.finish(Outcome::Cancelled);
    }

    /// The request ended with `outcome`. A prefill still reading its response after a
    /// completed request is left to end by itself (its task releases its load); otherwise it
    /// is aborted.
    pub fn end(mut self, outcome: Outcome) {
        if self.side.running() {
            if outcome == Outcome::Completed {
                self.task.take(); // detached: it ends by itself
                return;
            }
            self.abort_prefill();
        }
    }

    /// The instance a failed attempt blames: the prefill when it failed, else the decode.
    pub fn blamed(&self) -> InstanceKey {
        match self.side.failure() {
            Some(_) => self.prefill.key,
            None => self.decode.key,
        }
    }

    /// `p1+d1`.
    pub fn pair_name(&self) -> String {
        format!("{}+{}", self.prefill.id, self.decode.id)
    }
}

/// Asks an SGLang engine to abort request `rid` (fire and forget). The other side of a pair
/// may not have reached its engine yet when the abort is sent (both are sent at once): an
/// abort of an unknown id does nothing, and that request would then wait out its KV timeout.
/// So the abort is repeated a few times over about 1.5 s, unless the engine says it aborted
/// something (engine-sim answers `{"aborted": n}`; SGLang's answer carries no count, so
/// every try is sent: harmless, the id is unique to this attempt).
pub(super) fn abort(http: &reqwest::Client, inst: &Arc<Instance>, rid: &str) {
    let http = http.clone();
    let rid = rid.to_string();
    let inst = inst.clone();
    tokio::spawn(async move {
        let addr = inst.addr;
        for (i, wait_ms) in ABORT_RETRY_MS.iter().enumerate() {
            if *wait_ms > 0 {
                tokio::time::sleep(Duration::from_millis(*wait_ms)).await;
            }
            let r = inst
                .request(&http, reqwest::Method::POST, "/abort_request")
                .timeout(ABORT_TIMEOUT)
                .json(&json!({ "rid": rid }))
                .send()
                .await;
            match r {
                Ok(r) if r.status().is_success() => {
                    let n = r
                        .json::<Value>()
                        .await
                        .ok()
                        .and_then(|v| v.get("aborted").and_then(Value::as_u64));
                    debug!("abort {i} of request {rid} on {addr}: {n:?} aborted");
                    if n.is_some_and(|n| n > 0) {
                        return;
                    }
                }
                Ok(r) => debug!("abort of request {rid} on {addr}: {}", r.status()),
                Err(e) => debug!("abort of request {rid} on {addr} failed: {e}"),
            }
        }
    });
}

/// Pauses before each try of an abort (see [`abort`]).
const ABORT_RETRY_MS: [u64; 5] = [0, 100, 200, 400, 800];
