//! Request throttling: slot limits per instance or per service, and the FIFO queue of the
//! requests that wait for a slot.
//!
//! Slots (0 = no limit):
//! * `prefill` — requests from dispatch to their first token (queueing in the engine plus
//!   prefill). Integrated instances and prefill nodes.
//! * `total` — requests from dispatch to completion. Integrated instances only.
//! * `decode` — decode nodes of a prefill/decode-disaggregated service only: requests from
//!   their dispatch to the decode node (which first waits for the KV, then decodes) to
//!   completion, so that the requests decoding on a node never exceed it. On such a service
//!   `prefill` counts on the prefill nodes (dispatch to the end of the prefill) and `total`
//!   is not used.
//!
//! Scopes: `instance` — each instance is checked alone; only instances under their limits are
//! candidates (the pipelines' `HasFreeSlot` filter), and taking the slot is an atomic
//! check-and-increment on the instance's counters, so concurrent requests never overshoot.
//! `service` — the combined load of the service's instances is checked against the limit ×
//! the number of instances (a pool); the scheduler then picks among all of them.
//!
//! Overflow: `reject` answers 429 at once (`Retry-After`); `queue` waits in the queue: only
//! the head of the queue tries to take a slot, a released slot wakes the head, a head that
//! got its slot wakes the next. The queue belongs to the service name and survives a config
//! reload. A waiter that leaves (client gone, timeout) takes itself out of the queue.
//!
//! Queue order ([`Place`]): by class first (a tenant's priority: `interactive`, `default`,
//! `batch`), except that a waiter that has waited [`STARVATION_GUARD`] is overtaken by no
//! newcomer; within a class, start-time fair queueing over flows (tenants) weighted by
//! tokens: a waiter's tag is `max(virtual time, its flow's last finish)` and its flow's
//! finish moves on by the request's estimated tokens, the virtual time follows the tags of
//! the heads that leave. A flow with a deep backlog thus takes turns with a flow that sends
//! one request, each getting an equal share of the tokens. Without tenants every waiter is
//! of one flow and one class: FIFO.

use crate::load::{Limits, LoadSnapshot, SlotPool};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokengate_plugins::Role;
use tokio::sync::Notify;

/// What happens to a request when no slot is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overflow {
    /// 429 at once.
    #[default]
    Reject,
    /// Wait in a FIFO queue.
    Queue,
}

/// Where the limits are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scope {
    #[default]
    Instance,
    Service,
}

/// A service's throttling settings (resolved).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub overflow: Overflow,
    pub scope: Scope,
    /// Per-instance limits (integrated instances; the prefill limit also counts on prefill
    /// nodes).
    pub limits: Limits,
    /// Per decode node of a disaggregated service: requests from dispatch (waiting for their
    /// KV, then decoding) to completion; 0 = none.
    pub decode: u64,
    pub max_queue: usize,
    pub queue_timeout: Duration,
    pub retry_after: Duration,
}

/// One service's throttle: its settings, its service-wide slot pool and its queue. Kept
/// across reloads (by service name).
#[derive(Debug)]
pub struct Throttle {
    settings: RwLock<Settings>,
    pub pool: Arc<SlotPool>,
    /// The decode nodes' pool (scope `service` of a disaggregated service).
    pub decode_pool: Arc<SlotPool>,
    queue: Mutex<Queue>,
    next_id: AtomicU64,
}

/// A waiter that has waited this long is overtaken by no newcomer of a higher class (the
/// lowest class is not starved by a steady stream of higher ones).
pub const STARVATION_GUARD: Duration = Duration::from_secs(5);

/// Where a request goes in the queue: its class (0 first) and, within it, its flow (its
/// tenant) and cost (its estimated tokens).
#[derive(Debug, Clone, Default)]
pub struct Place {
    pub class: u8,
    pub flow: String,
    pub cost: u64,
}

#[derive(Debug, Default)]
struct Queue {
    waiters: VecDeque<Waiter>,
    /// The tag of the last head that left.
    vtime: f64,
    /// Each flow's last finish tag (cleared when the queue empties).
    finish: HashMap<String, f64>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: Arc<Notify>,
    class: u8,
    tag: f64,
    since: std::time::Instant,
}

impl Waiter {
    /// Whether a newcomer of `class` and `tag` stays behind this waiter.
    fn keeps_ahead_of(&self, class: u8, tag: f64) -> bool {
        self.class < class
            || (self.class == class && self.tag <= tag)
            || self.since.elapsed() >= STARVATION_GUARD
    }
}

/// Why a request did not get a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No slot free and `overflow: reject` (or a retry with none free).
    Limit,
    /// The queue already holds `max_queue` requests.
    QueueFull,
    /// Waited `queue_timeout`.
    QueueTimeout,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Limit => "limit",
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
        }
    }
}

impl Throttle {
    pub fn new(settings: Settings) -> Self {
        Throttle {
            settings: RwLock::new(settings),
            pool: Arc::new(SlotPool::default()),
            decode_pool: Arc::new(SlotPool::default()),
            queue: Mutex::new(Queue::default()),
            next_id: AtomicU64::new(0),
        }
    }

    pub fn settings(&self) -> Settings {
        self.settings.read().clone()
    }

    /// New settings (a reload); the queue and the slots in use stay.
    pub fn set(&self, s: Settings) {
        *self.settings.write() = s;
        self.kick();
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.queue.lock().waiters.len()
    }

    /// A slot was released: wake the head of the queue (it tries to take one).
    pub fn kick(&self) {
        if let Some(w) = self.queue.lock().waiters.front() {
            w.wake.notify_one();
        }
    }

    /// Joins the queue at the back (one class, one flow), unless it holds `max_queue`
    /// requests already.
    pub fn enqueue(self: &Arc<Self>) -> Result<Ticket, Refusal> {
        self.enqueue_at(&Place::default())
    }

    /// Joins the queue at its [`Place`], unless it holds `max_queue` requests already.
    pub fn enqueue_at(self: &Arc<Self>, place: &Place) -> Result<Ticket, Refusal> {
        let max = self.settings.read().max_queue;
        let mut guard = self.queue.lock();
        let q = &mut *guard;
        if q.waiters.len() >= max {
            return Err(Refusal::QueueFull);
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        let wake = Arc::new(Notify::new());
        let finish = q.finish.entry(place.flow.clone()).or_insert(0.0);
        let tag = finish.max(q.vtime);
        *finish = tag + place.cost.max(1) as f64;
        let at = q
            .waiters
            .iter()
            .rposition(|w| w.keeps_ahead_of(place.class, tag))
            .map_or(0, |p| p + 1);
        q.waiters.insert(
            at,
            Waiter {
                id,
                wake: wake.clone(),
                class: place.class,
                tag,
                since: std::time::Instant::now(),
            },
        );
        if at == 0 {
            // A new head (it overtook the old one): it tries for a slot.
            wake.notify_one();
        }
        Ok(Ticket {
            throttle: self.clone(),
            id,
            wake,
        })
    }
}

/// The throttling phases of an instance, as `tokengate_slots_in_use{instance,phase}` and
/// `tokengate_slot_limit{instance,phase}` report them: `(phase, in use, limit per instance)`
/// for `prefill`, `decode` and `total` (limit 0: none). A decode node counts its requests
/// from dispatch (waiting for their KV) against `decode`; a prefill node only has prefill
/// slots. With scope `service` the limit is the per-instance figure of the service's pool.
pub fn slot_phases(role: Role, l: &LoadSnapshot, st: &Settings) -> [(&'static str, u64, u64); 3] {
    let lim = st.limits;
    match role {
        Role::Decode => [
            ("prefill", 0, 0),
            ("decode", l.inflight_requests, st.decode),
            ("total", l.inflight_requests, 0),
        ],
        Role::Prefill => [
            ("prefill", l.waiting, lim.prefill),
            ("decode", 0, 0),
            ("total", l.inflight_requests, 0),
        ],
        Role::Integrated => [
            ("prefill", l.waiting, lim.prefill),
            ("decode", l.inflight_requests.saturating_sub(l.waiting), 0),
            ("total", l.inflight_requests, lim.total),
        ],
    }
}

/// A place in a service's queue; leaving it (drop) wakes the next waiter.
#[derive(Debug)]
pub struct Ticket {
    throttle: Arc<Throttle>,
    id: u64,
    wake: Arc<Notify>,
}

impl Ticket {
    /// Whether this waiter is the head of the queue (the one that may take a slot).
    pub fn is_head(&self) -> bool {
        self.throttle
            .queue
            .lock()
            .waiters
            .front()
            .is_some_and(|w| w.id == self.id)
    }

    /// Woken: a slot was released while this waiter was the head (or the head left).
    pub async fn woken(&self) {
        self.wake.notified().await
    }

    /// 1-based position in the queue.
    pub fn position(&self) -> usize {
        self.throttle
            .queue
            .lock()
            .waiters
            .iter()
            .position(|w| w.id == self.id)
            .map_or(0, |p| p + 1)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut guard = self.throttle.queue.lock();
        let q = &mut *guard;
        if let Some(p) = q.waiters.iter().position(|w| w.id == self.id) {
            if let Some(w) = q.waiters.remove(p) {
                if p == 0 {
                    q.vtime = q.vtime.max(w.tag);
                }
            }
        }
        if q.waiters.is_empty() {
            // No backlog: the next one starts every flow even.
            q.vtime = 0.0;
            q.finish.clear();
        }
        // The next head tries for a slot: a free one (the one this waiter got is taken, but
        // more may be free), or it waits for the next release.
        if let Some(w) = q.waiters.front() {
            w.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(max_queue: usize) -> Settings {
        Settings {
            overflow: Overflow::Queue,
            scope: Scope::Instance,
            limits: Limits {
                prefill: 1,
                total: 0,
            },
            decode: 0,
            max_queue,
            queue_timeout: Duration::from_secs(1),
            retry_after: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn fifo_with_a_bound_and_clean_leaving() {
        let t = Arc::new(Throttle::new(settings(2)));
        let a = t.enqueue().unwrap();
        let b = t.enqueue().unwrap();
        assert_eq!(t.enqueue().unwrap_err(), Refusal::QueueFull);
        assert!(a.is_head() && !b.is_head());
        assert_eq!((a.position(), b.position()), (1, 2));
        // A release wakes the head (the permit is kept until it waits).
        t.kick();
        a.woken().await;
        // The head leaves: b becomes the head and is woken.
        drop(a);
        assert!(b.is_head());
        b.woken().await;
        // A waiter in the middle that leaves (client gone) frees its place.
        let c = t.enqueue().unwrap();
        let d = t.enqueue().unwrap_err();
        assert_eq!(d, Refusal::QueueFull);
        drop(c);
        assert_eq!(t.queued(), 1);
        drop(b);
        assert_eq!(t.queued(), 0);
    }

    #[test]
    fn classes_first_then_fair_shares_of_tokens() {
        let t = Arc::new(Throttle::new(settings(100)));
        let at = |class: u8, flow: &str| Place {
            class,
            flow: flow.into(),
            cost: 100,
        };
        // A deep backlog of one flow, then one request of another: it goes second.
        let heavy: Vec<Ticket> = (0..5).map(|_| t.enqueue_at(&at(1, "h")).unwrap()).collect();
        let light = t.enqueue_at(&at(1, "l")).unwrap();
        assert_eq!(light.position(), 2);
        // A batch request queues behind them, an interactive one in front of everything.
        let batch = t.enqueue_at(&at(2, "b")).unwrap();
        assert_eq!(batch.position(), 7);
        let inter = t.enqueue_at(&at(0, "i")).unwrap();
        assert!(inter.is_head());
        drop((heavy, light, batch, inter));
        assert_eq!(t.queued(), 0);
    }

    #[test]
    fn a_waiter_past_the_starvation_guard_is_not_overtaken() {
        let t = Arc::new(Throttle::new(settings(100)));
        let at = |class: u8| Place {
            class,
            flow: String::new(),
            cost: 100,
        };
        let old = t.enqueue_at(&at(2)).unwrap();
        let young = t.enqueue_at(&at(2)).unwrap();
        // The first batch waiter has waited past the guard (moved back in time, no sleep).
        if let Some(w) = t.queue.lock().waiters.front_mut() {
            w.since = std::time::Instant::now()
                .checked_sub(STARVATION_GUARD)
                .unwrap();
        }
        let inter = t.enqueue_at(&at(0)).unwrap();
        assert!(old.is_head());
        assert_eq!((inter.position(), young.position()), (2, 3));
    }
}
