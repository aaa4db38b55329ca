//! SGLang-style request abort: `rid` and `POST /abort_request`.
//!
//! Every inference request in flight holds a [`Ticket`] in the engine's
//! [`Aborts`] table, under the optional string `rid` of its body (SGLang's
//! `GenerateReqInput.rid`; a gateway injects the same rid into the bodies it
//! sends to a prefill and a decode engine). The ticket is an RAII guard: it is
//! removed when the request ends, however it ends (finished, failed, client gone),
//! so the table never outlives its requests. Several requests may share a rid.
//!
//! `POST /abort_request` `{"rid": "x"}` signals every request registered under
//! `"x"` (exact match: SGLang's tokenizer manager looks the rid up exactly before
//! its scheduler matches it as a prefix, which only adds the `rid_<n>`
//! sub-requests of `n > 1`); `{"abort_all": true}` signals all of them. The
//! signal is an [`AbortRx`] each phase of a request waits on:
//!
//! * the scheduler ([`crate::engine`]) drops a queued or running request, frees
//!   its KV blocks and sends it [`crate::engine::Ev::Aborted`];
//! * a PD decode waiting for its KV stops waiting ([`crate::pd::receive_kv`]);
//! * an SGLang PD prefill holding its KV for a decode fails the room and
//!   releases the KV ([`crate::pd::relay_prefill`]).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

/// Which in-flight requests `POST /abort_request` names.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Target<'a> {
    Rid(&'a str),
    All,
}

struct Entry {
    rid: Option<String>,
    tx: watch::Sender<bool>,
}

#[derive(Default)]
struct Table {
    next: u64,
    entries: HashMap<u64, Entry>,
}

/// The in-flight inference requests of one engine, by ticket.
#[derive(Default)]
pub(crate) struct Aborts {
    table: Mutex<Table>,
}

impl Aborts {
    /// Register a request for its lifetime. `name` (the rid, or the response id
    /// when the body has none) is used in error messages.
    pub(crate) fn register(self: &Arc<Self>, rid: Option<String>, name: &str) -> Ticket {
        let (tx, rx) = watch::channel(false);
        let id = {
            let mut t = self.table.lock();
            let id = t.next;
            t.next += 1;
            t.entries.insert(
                id,
                Entry {
                    rid: rid.clone(),
                    tx,
                },
            );
            id
        };
        Ticket {
            aborts: self.clone(),
            id,
            name: rid.unwrap_or_else(|| name.to_string()),
            rx: AbortRx(rx),
        }
    }

    /// Signal the requests `target` names; returns how many were signalled
    /// (in flight and not signalled before).
    pub(crate) fn abort(&self, target: Target<'_>) -> usize {
        let t = self.table.lock();
        let mut n = 0;
        for e in t.entries.values() {
            let hit = match target {
                Target::All => true,
                Target::Rid(rid) => e.rid.as_deref() == Some(rid),
            };
            if hit && !e.tx.send_replace(true) {
                n += 1;
            }
        }
        n
    }

    /// Requests registered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().entries.len()
    }
}

/// An in-flight request's registration; dropping it unregisters the request.
pub(crate) struct Ticket {
    aborts: Arc<Aborts>,
    id: u64,
    name: String,
    rx: AbortRx,
}

impl Ticket {
    /// The rid, or the response id when the request has no rid.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A receiver of this request's abort signal.
    pub(crate) fn signal(&self) -> AbortRx {
        self.rx.clone()
    }

    /// The error message of a request ended by an abort.
    pub(crate) fn message(&self) -> String {
        format!(
            "Abort request {}: aborted by POST /abort_request",
            self.name
        )
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.aborts.table.lock().entries.remove(&self.id);
    }
}

/// One request's abort signal.
#[derive(Clone, Debug)]
pub(crate) struct AbortRx(watch::Receiver<bool>);

impl AbortRx {
    /// Whether the request was aborted.
    pub(crate) fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the request is aborted; never if it ended (its ticket was
    /// dropped) without being aborted.
    pub(crate) async fn wait(&mut self) {
        let aborted = self.0.wait_for(|a| *a).await.is_ok();
        if !aborted {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn abort_by_rid_and_all() {
        let aborts = Arc::new(Aborts::default());
        let a1 = aborts.register(Some("a".into()), "cmpl-1");
        let a2 = aborts.register(Some("a".into()), "cmpl-2");
        let b = aborts.register(Some("b".into()), "cmpl-3");
        let anon = aborts.register(None, "cmpl-4");
        assert_eq!((a1.name(), anon.name()), ("a", "cmpl-4"));
        assert_eq!(aborts.abort(Target::Rid("zzz")), 0);
        assert_eq!(aborts.abort(Target::Rid("a")), 2);
        assert!(a1.signal().is_set() && a2.signal().is_set());
        assert!(!b.signal().is_set() && !anon.signal().is_set());
        // already signalled: not counted again
        assert_eq!(aborts.abort(Target::All), 2);
        assert!(anon.signal().is_set());
        let mut rx = b.signal();
        rx.wait().await;
        drop((a1, a2, b));
        assert_eq!(aborts.len(), 1);
        drop(anon);
        assert_eq!(aborts.len(), 0);
        assert_eq!(aborts.abort(Target::All), 0);
    }

    #[tokio::test]
    async fn wait_never_resolves_after_a_normal_end() {
        let aborts = Arc::new(Aborts::default());
        let t = aborts.register(None, "x");
        let mut rx = t.signal();
        drop(t);
        let r = tokio::time::timeout(std::time::Duration::from_millis(20), rx.wait()).await;
        assert!(r.is_err());
    }
}
