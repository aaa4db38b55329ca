//! The prefill side: relaying the scheduler's events to the response, publishing the KV
//! and holding the response until a decode took it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::abort::AbortRx;
use crate::engine::{Engine, Ev};
use crate::{PdMode, SimConfig};

use super::registry::{KvInfo, Registry};

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
