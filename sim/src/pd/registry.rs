//! The KV a prefill engine publishes, keyed by SGLang room or vLLM transfer id: publishing,
//! claiming, confirming, failing, and the garbage collection of old slots.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::SimConfig;

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

pub(super) struct Slot {
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
pub(super) enum Claim {
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
    pub(super) fn publish(&self, key: &str, info: KvInfo) -> Result<Arc<Slot>, String> {
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
    pub(super) async fn claim(
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
    pub(super) fn done(&self, key: &str) -> bool {
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
    pub(super) async fn wait_done(slot: &Slot, timeout: Duration) -> bool {
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
