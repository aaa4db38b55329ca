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
//!
//! Fleet-wide fairness (`cluster:`, see [`crate::background::cluster`]): each replica counts
//! the tokens it grants per flow (an exponentially decayed sum, [`SERVED_DECAY`]) and
//! publishes them with its backlog per flow, off the request path; it reads the other
//! replicas' in return ([`Throttle::set_fleet`]). Two things use them:
//! * **order** — a newcomer's place is its tag plus what its flow was served through the
//!   other replicas beyond the least-served flow queued here, so a tenant served a lot
//!   through replica A is behind on replica B too;
//! * **yield** — the head of this replica's queue does not try for a (fleet-wide) slot while
//!   a flow of its class or a better one waits on another replica having been served fewer
//!   tokens fleet-wide (by more than the head's cost): that replica, woken by the same
//!   release, takes it. A head yields at most [`YIELD_MAX`] (stale figures cost no more),
//!   then tries anyway.
//!
//! Without Redis (or while it is away) the figures are empty and the queue is fair per
//! replica only.

use crate::load::{Limits, LoadSnapshot, SlotPool};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
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
    /// Part of a cluster (its figures are exchanged): grants are counted per flow.
    clustered: AtomicBool,
}

/// The time constant of the decay of the tokens served per flow that the replicas compare
/// (an older grant counts `e^(-age / SERVED_DECAY)`).
pub const SERVED_DECAY: Duration = Duration::from_secs(5);

/// The longest the head of a queue waits (yields) for a less-served flow backlogged on
/// another replica to take the fleet's free slot.
pub const YIELD_MAX: Duration = Duration::from_millis(500);

/// How often a yielding head looks again (the other replicas' figures may have changed).
const YIELD_RECHECK: Duration = Duration::from_millis(20);

/// What the other replicas report of one flow of a service: tokens served (decayed, as of
/// the report), requests waiting, and the best class among them (0 first).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Remote {
    pub served: f64,
    pub backlog: u64,
    pub class: u8,
}

/// One flow of this replica as [`Throttle::fleet_report`] gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowReport {
    pub flow: String,
    pub served: f64,
    pub backlog: u64,
    pub class: u8,
}

/// A decayed sum (see [`SERVED_DECAY`]).
#[derive(Debug, Clone, Copy, Default)]
struct Decayed {
    value: f64,
    at_ms: u64,
}

impl Decayed {
    fn at(&self, now_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(self.at_ms) as f64;
        self.value * (-age / SERVED_DECAY.as_millis() as f64).exp()
    }

    fn add(&mut self, x: f64, now_ms: u64) {
        self.value = self.at(now_ms) + x;
        self.at_ms = now_ms;
    }
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
    /// Tokens granted per flow by this replica (clustered only).
    served: HashMap<String, Decayed>,
    /// The other replicas' figures per flow (empty: none known, per-replica fairness).
    remote: HashMap<String, Remote>,
    /// The head that yields its turn, and since when.
    yielding: Option<(u64, std::time::Instant)>,
    /// Requests granted from the queue since the last [`Throttle::fleet_report`].
    granted: u64,
}

impl Queue {
    /// Tokens served to `flow` fleet-wide (this replica's and the others').
    fn fleet_served(&self, flow: &str, now_ms: u64) -> f64 {
        self.served.get(flow).map_or(0.0, |d| d.at(now_ms))
            + self.remote.get(flow).map_or(0.0, |r| r.served)
    }

    /// Whether the head `w` should leave the fleet's free slot to a flow that waits on
    /// another replica having been served less (see the module docs).
    fn yields(&self, w: &Waiter, now_ms: u64) -> bool {
        if self.remote.is_empty() {
            return false;
        }
        let mine = self.fleet_served(&w.flow, now_ms);
        self.remote.iter().any(|(flow, r)| {
            *flow != w.flow
                && r.backlog > 0
                && r.class <= w.class
                && self.fleet_served(flow, now_ms) + w.cost as f64 <= mine
        })
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: Arc<Notify>,
    class: u8,
    tag: f64,
    /// The tag plus the flow's service through the other replicas beyond the least-served
    /// flow queued here: the order within a class.
    key: f64,
    flow: String,
    cost: u64,
    since: std::time::Instant,
}

impl Waiter {
    /// Whether a newcomer of `class` and order `key` stays behind this waiter.
    fn keeps_ahead_of(&self, class: u8, key: f64) -> bool {
        self.class < class
            || (self.class == class && self.key <= key)
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
            clustered: AtomicBool::new(false),
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
        let key = tag + q.behind(&place.flow, place.class);
        let at = q
            .waiters
            .iter()
            .rposition(|w| w.keeps_ahead_of(place.class, key))
            .map_or(0, |p| p + 1);
        q.waiters.insert(
            at,
            Waiter {
                id,
                wake: wake.clone(),
                class: place.class,
                tag,
                key,
                flow: place.flow.clone(),
                cost: place.cost.max(1),
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

impl Queue {
    /// How far behind a newcomer of `flow` goes for what the other replicas served it beyond
    /// the least-served flow of its class queued here (0 without fleet figures).
    fn behind(&self, flow: &str, class: u8) -> f64 {
        if self.remote.is_empty() {
            return 0.0;
        }
        let elsewhere = |f: &str| self.remote.get(f).map_or(0.0, |r| r.served);
        let least = self
            .waiters
            .iter()
            .filter(|w| w.class == class)
            .map(|w| elsewhere(&w.flow))
            .fold(elsewhere(flow), f64::min);
        elsewhere(flow) - least
    }
}

impl Throttle {
    /// A request of `flow` got a slot without queueing: counted in its flow's service
    /// (clustered only: the replicas compare it).
    pub fn served(&self, flow: &str, cost: u64) {
        if self.clustered.load(Relaxed) {
            let now = crate::clock::now_ms();
            let mut q = self.queue.lock();
            match q.served.get_mut(flow) {
                Some(d) => d.add(cost.max(1) as f64, now),
                None => {
                    let mut d = Decayed::default();
                    d.add(cost.max(1) as f64, now);
                    q.served.insert(flow.to_string(), d);
                }
            }
        }
    }

    /// This replica's figures per flow for the other replicas (tokens served, decayed;
    /// requests waiting; their best class), and the requests granted from the queue since
    /// the last report. Marks the throttle as part of a cluster.
    pub fn fleet_report(&self) -> (Vec<FlowReport>, u64) {
        self.clustered.store(true, Relaxed);
        let now = crate::clock::now_ms();
        let mut guard = self.queue.lock();
        let q = &mut *guard;
        // Flows served long ago are forgotten (under a token of weight left).
        q.served.retain(|_, d| d.at(now) >= 1.0);
        let mut out: Vec<FlowReport> = q
            .served
            .iter()
            .map(|(flow, d)| FlowReport {
                flow: flow.clone(),
                served: d.at(now),
                backlog: 0,
                class: u8::MAX,
            })
            .collect();
        for w in &q.waiters {
            let i = match out.iter().position(|r| r.flow == w.flow) {
                Some(i) => i,
                None => {
                    out.push(FlowReport {
                        flow: w.flow.clone(),
                        served: 0.0,
                        backlog: 0,
                        class: u8::MAX,
                    });
                    out.len() - 1
                }
            };
            out[i].backlog += 1;
            out[i].class = out[i].class.min(w.class);
        }
        (out, std::mem::take(&mut q.granted))
    }

    /// The other replicas' figures per flow (empty: Redis away, fair per replica). No wake:
    /// a yielding head looks again every `YIELD_RECHECK` anyway, and new figures cannot
    /// free a slot for one that is not.
    pub fn set_fleet(&self, remote: HashMap<String, Remote>) {
        let mut q = self.queue.lock();
        if q.remote.is_empty() && remote.is_empty() {
            return;
        }
        q.remote = remote;
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

    /// Whether this waiter may try for a slot now: it is the head, and it does not leave
    /// the fleet's next slot to a less-served flow waiting on another replica (see the
    /// module docs; at most [`YIELD_MAX`]).
    pub fn may_try(&self) -> bool {
        let mut guard = self.throttle.queue.lock();
        let q = &mut *guard;
        let Some(w) = q.waiters.front().filter(|w| w.id == self.id) else {
            return false;
        };
        if !q.yields(w, crate::clock::now_ms()) {
            q.yielding = None;
            return true;
        }
        match q.yielding {
            Some((id, since)) if id == self.id => since.elapsed() >= YIELD_MAX,
            _ => {
                q.yielding = Some((self.id, std::time::Instant::now()));
                false
            }
        }
    }

    /// Woken: a slot was released while this waiter was the head (or the head left); a
    /// head that yields looks again after a short while too.
    pub async fn woken(&self) {
        let yielding = self
            .throttle
            .queue
            .lock()
            .yielding
            .is_some_and(|(id, _)| id == self.id);
        if yielding {
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(YIELD_RECHECK) => {}
            }
        } else {
            self.wake.notified().await
        }
    }

    /// The waiter got its slot: its tokens count as its flow's service (clustered only).
    pub fn granted(&self) {
        if !self.throttle.clustered.load(Relaxed) {
            return;
        }
        let now = crate::clock::now_ms();
        let mut guard = self.throttle.queue.lock();
        let q = &mut *guard;
        q.granted += 1;
        if let Some(w) = q.waiters.iter().find(|w| w.id == self.id) {
            let cost = w.cost as f64;
            match q.served.get_mut(&w.flow) {
                Some(d) => d.add(cost, now),
                None => {
                    let mut d = Decayed::default();
                    d.add(cost, now);
                    q.served.insert(w.flow.clone(), d);
                }
            }
        }
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
        if q.yielding.is_some_and(|(id, _)| id == self.id) {
            q.yielding = None;
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

    #[test]
    fn fleet_figures_put_a_flow_served_elsewhere_behind_and_make_a_head_yield() {
        let t = Arc::new(Throttle::new(settings(100)));
        let at = |flow: &str| Place {
            class: 1,
            flow: flow.into(),
            cost: 100,
        };
        let _ = t.fleet_report();
        // The other replicas served "h" 1000 tokens; "l" waits there, served nothing.
        let remote = |backlog| {
            HashMap::from([
                (
                    "h".to_string(),
                    Remote {
                        served: 1000.0,
                        backlog: 0,
                        class: u8::MAX,
                    },
                ),
                (
                    "l".to_string(),
                    Remote {
                        served: 0.0,
                        backlog,
                        class: 1,
                    },
                ),
            ])
        };
        t.set_fleet(remote(1));
        let ls: Vec<Ticket> = (0..3).map(|_| t.enqueue_at(&at("l")).unwrap()).collect();
        // Alone, "h" would go second; served elsewhere, it goes behind the three.
        let h = t.enqueue_at(&at("h")).unwrap();
        assert_eq!(h.position(), 4);
        drop(ls);
        assert!(h.is_head());
        // The head leaves the fleet's slot to "l", waiting elsewhere, for at most YIELD_MAX.
        assert!(!h.may_try());
        assert!(!h.may_try());
        if let Some((_, since)) = t.queue.lock().yielding.as_mut() {
            *since = std::time::Instant::now().checked_sub(YIELD_MAX).unwrap();
        }
        assert!(h.may_try());
        // "l" no longer waits anywhere: no yield; without figures (Redis away) neither.
        t.set_fleet(remote(0));
        assert!(h.may_try());
        t.set_fleet(remote(1));
        t.set_fleet(HashMap::new());
        assert!(h.may_try());
        // Its grant counts as its flow's service in the report.
        h.granted();
        let (flows, granted) = t.fleet_report();
        assert_eq!(granted, 1);
        assert!(flows
            .iter()
            .any(|f| f.flow == "h" && f.served > 99.0 && f.backlog == 1));
    }
}
