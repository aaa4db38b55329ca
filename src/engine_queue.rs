//! The queue of a saturated engine, kept at the gateway and served shortest predicted work
//! first (`services[].engine_queue`; on by default while every instance of the service is
//! saturated).
//!
//! An engine serves its waiting requests in arrival order (vLLM's and SGLang's default
//! scheduling, engine-sim's): a warm turn whose few hundred uncached tokens take 0.2 s waits
//! behind every cold 4k-token prompt sent before it. Once an instance has `depth` requests
//! sent and waiting for their first token, and their predicted prefill is at least
//! `min_queued`, it is *saturated*. With `scope: service` (the default) the gateway holds
//! requests only while every available instance of the service is saturated (or its own
//! instance already holds some): the fleet is overloaded and any placement queues; with
//! `scope: instance` whenever its own instance is. A held request waits here with its key
//! `arrival + own prefill` (predicted at that instance: its uncached tokens at the
//! instance's learned rate), and whenever one of the sent requests gets its first token (or
//! fails, or leaves) the waiter with the smallest key is sent.
//!
//! The key is a virtual finish time: a short request overtakes a long one that arrived less
//! than the long one's own prefill before it, so a long prompt is delayed by the short work
//! arriving during its own prefill (about utilization × its own prefill), never starved. The
//! placement is unchanged — the scheduler chose the instance at arrival and the request's
//! load counts there while it waits, so the queue figures the scheduler compares are the
//! same —, only the order in which the engine receives its queue changes. Below saturation
//! nothing is held: with fewer than `depth` sent, or less than `min_queued` of predicted
//! prefill sent, a request goes at once (an engine that batches prefills keeps a batch's
//! worth). A warm request (at least half its prompt cached there) that would be the next
//! sent anyway goes to the engine at once, saturated or not, so that the engine keeps its
//! cached prefix while it waits ([`EngineQueue::enter`]).
//!
//! Only streamed requests go through it (the caller's choice): a non-stream answer's first
//! token is its last, so its slot would be held through its whole decode.
//!
//! Why `scope: service` by default: in the workload matrix (`docs/matrix-runs.md`, run
//! 26) it takes the overload cell's p50 from 1.15 to 1.08 × smg's (p99 0.70 → 0.76 ×) and
//! leaves the cells where some instance has room as they were; `scope: instance` (run 25)
//! engages in every busy cell and lost ties there.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

pub use crate::throttle::Scope;

/// When an instance's queue is held (resolved `services[].engine_queue`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Hold requests at all (`hold: false`: every request is sent at once).
    pub hold: bool,
    /// `Service`: only while every instance of the service is saturated (or the request's
    /// own instance already holds some); `Instance`: while its own instance is.
    pub scope: Scope,
    /// Requests sent and waiting for their first token before the gateway holds the next.
    pub depth: u32,
    /// ... and their predicted prefill, ms (an engine that batches prefills keeps this much).
    pub min_queued_ms: f64,
}

/// Default `depth`: only the request prefilling (while its predicted prefill is at least
/// `min_queued`). The next is sent at its first token, a round trip between two prefills of
/// hundreds of milliseconds; everything behind it is ordered here. With one request in the
/// engine at a time, a request also finds nothing queued ahead of it there, so the
/// instance's prefill rate keeps being learned while it is saturated (the rate is learned only
/// from such requests). Depth 2 left the overloaded cell's p50 where it was (4,419 vs 4,410 ms,
/// seed 1: an engine there had ~4 waiting, 1-2 held, little to reorder, and the rate stayed
/// at the prior, 8k tokens/s where the engines did 1.1k); depth 1 took it to 3,446 ms.
pub const DEFAULT_DEPTH: u32 = 1;
/// Default `min_queued`: an engine is given more than one request while the prefill sent
/// to it is predicted shorter than this (a fast engine batches short prefills).
pub const DEFAULT_MIN_QUEUED: Duration = Duration::from_millis(250);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            hold: true,
            scope: Scope::Service,
            depth: DEFAULT_DEPTH,
            min_queued_ms: DEFAULT_MIN_QUEUED.as_secs_f64() * 1000.0,
        }
    }
}

/// One instance's queue (kept across reloads with the instance's load).
#[derive(Debug, Default)]
pub struct EngineQueue {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Sent through this queue and waiting for their first token.
    sent: u32,
    /// Their predicted prefill, ms, and tokens.
    sent_ms: f64,
    sent_tokens: u64,
    /// Held at the gateway, unordered (a handful; the smallest key is searched).
    held: Vec<Held>,
    next_id: u64,
    /// The settings of the last request that entered (a reload changes them).
    settings: Settings,
}

#[derive(Debug)]
struct Held {
    id: u64,
    key: f64,
    own_ms: f64,
    tokens: u64,
    wake: Arc<Notify>,
    granted: Arc<AtomicBool>,
    /// Tokens sent ahead of it when it was sent.
    ahead: Arc<Mutex<u64>>,
}

impl Inner {
    fn has_room(&self) -> bool {
        self.room_under(&self.settings)
    }

    fn room_under(&self, s: &Settings) -> bool {
        !s.hold || self.sent < s.depth.max(1) || self.sent_ms < s.min_queued_ms
    }

    fn send(&mut self, own_ms: f64, tokens: u64) {
        self.sent += 1;
        self.sent_ms += own_ms;
        self.sent_tokens += tokens;
    }

    fn release(&mut self, own_ms: f64, tokens: u64) {
        self.sent = self.sent.saturating_sub(1);
        self.sent_ms = (self.sent_ms - own_ms).max(0.0);
        self.sent_tokens = self.sent_tokens.saturating_sub(tokens);
        if self.sent == 0 {
            self.sent_ms = 0.0;
            self.sent_tokens = 0;
        }
        self.pump();
    }

    /// Sends the held requests with the smallest keys while there is room.
    fn pump(&mut self) {
        while !self.held.is_empty() && self.has_room() {
            let i = self
                .held
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.key.total_cmp(&b.1.key).then(a.1.id.cmp(&b.1.id)))
                .map_or(0, |(i, _)| i);
            let h = self.held.swap_remove(i);
            *h.ahead.lock() = self.sent_tokens;
            self.send(h.own_ms, h.tokens);
            h.granted.store(true, Relaxed);
            h.wake.notify_one();
        }
    }
}

/// A request sent through an instance's queue: until [`Slot::release`] (its first token) or
/// its drop, it counts as sent there.
#[derive(Debug)]
pub struct Slot {
    queue: Arc<EngineQueue>,
    own_ms: f64,
    tokens: u64,
    /// Tokens sent ahead of it (through this queue) when it was sent.
    pub ahead_tokens: u64,
    /// How long it was held (zero: sent at once).
    pub held: Duration,
    live: bool,
}

impl Slot {
    /// Its first token: the engine's queue is one shorter, the next waiter goes.
    pub fn release(&mut self) {
        if std::mem::take(&mut self.live) {
            self.queue.inner.lock().release(self.own_ms, self.tokens);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release();
    }
}

/// A request held at the gateway: [`Waiter::sent`] waits for its turn; dropped before
/// (the client left), it leaves the queue.
#[derive(Debug)]
pub struct Waiter {
    queue: Arc<EngineQueue>,
    id: u64,
    own_ms: f64,
    tokens: u64,
    wake: Arc<Notify>,
    granted: Arc<AtomicBool>,
    ahead: Arc<Mutex<u64>>,
    since: std::time::Instant,
    done: bool,
}

impl Waiter {
    /// Waits until it is sent.
    pub async fn sent(mut self) -> Slot {
        while !self.granted.load(Relaxed) {
            self.wake.notified().await;
        }
        self.done = true;
        Slot {
            queue: self.queue.clone(),
            own_ms: self.own_ms,
            tokens: self.tokens,
            ahead_tokens: *self.ahead.lock(),
            held: self.since.elapsed(),
            live: true,
        }
    }

    /// Requests held at this instance (itself included).
    pub fn held(&self) -> usize {
        self.queue.held()
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut q = self.queue.inner.lock();
        if self.granted.load(Relaxed) {
            // Sent while it was leaving: the place goes to the next.
            q.release(self.own_ms, self.tokens);
        } else if let Some(i) = q.held.iter().position(|h| h.id == self.id) {
            q.held.swap_remove(i);
        }
    }
}

/// What [`EngineQueue::enter`] gives: sent at once, or held.
#[derive(Debug)]
pub enum Entry {
    Sent(Slot),
    Held(Waiter),
}

impl EngineQueue {
    /// A request of `own_ms` predicted prefill (`tokens` uncached tokens) arriving at
    /// `now_ms`: sent at once when nobody is held and the instance has room (or, with
    /// `fleet_full` false, another instance of the service has: see [`Scope`]), else held
    /// with the key `now_ms + own_ms` — unless it is `warm` (most of its prompt is cached there)
    /// and its key is below every held one: it would be the next sent anyway, so it goes to
    /// the engine now, where its cached prefix is kept while it waits (an engine looks a
    /// request's prefix up when the request enters it; a request held here keeps nothing,
    /// and on a busy engine its session's history is evicted while it waits). It counts as
    /// sent, so the held requests wait for it too.
    pub fn enter(
        self: &Arc<Self>,
        st: Settings,
        own_ms: f64,
        tokens: u64,
        now_ms: u64,
        warm: bool,
        fleet_full: bool,
    ) -> Entry {
        let own_ms = if own_ms.is_finite() {
            own_ms.max(0.0)
        } else {
            0.0
        };
        let mut q = self.inner.lock();
        let changed = q.settings != st;
        q.settings = st;
        if changed {
            // Looser settings (a reload): the held may go now.
            q.pump();
        }
        let key = now_ms as f64 + own_ms;
        // A warm request next in line (its key below every held one) goes too.
        if (q.held.is_empty() && (q.has_room() || !fleet_full))
            || (warm && q.held.iter().all(|h| key < h.key))
        {
            let ahead = q.sent_tokens;
            q.send(own_ms, tokens);
            return Entry::Sent(Slot {
                queue: self.clone(),
                own_ms,
                tokens,
                ahead_tokens: ahead,
                held: Duration::ZERO,
                live: true,
            });
        }
        q.next_id += 1;
        let id = q.next_id;
        let wake = Arc::new(Notify::new());
        let granted = Arc::new(AtomicBool::new(false));
        let ahead = Arc::new(Mutex::new(0));
        q.held.push(Held {
            id,
            key,
            own_ms,
            tokens,
            wake: wake.clone(),
            granted: granted.clone(),
            ahead: ahead.clone(),
        });
        Entry::Held(Waiter {
            queue: self.clone(),
            id,
            own_ms,
            tokens,
            wake,
            granted,
            ahead,
            since: std::time::Instant::now(),
            done: false,
        })
    }

    /// Whether it takes no request at once under `st`: saturated, or some held (what
    /// `fleet_full` of [`EngineQueue::enter`] asks of every instance).
    pub fn full(&self, st: &Settings) -> bool {
        let q = self.inner.lock();
        !q.held.is_empty() || !q.room_under(st)
    }

    /// Requests held here.
    pub fn held(&self) -> usize {
        self.inner.lock().held.len()
    }

    /// Requests sent through this queue and waiting for their first token.
    pub fn sent(&self) -> u32 {
        self.inner.lock().sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st() -> Settings {
        Settings {
            hold: true,
            scope: Scope::Instance,
            depth: 2,
            min_queued_ms: 0.0,
        }
    }

    fn sent(e: Entry) -> Slot {
        match e {
            Entry::Sent(s) => s,
            Entry::Held(_) => panic!("held, expected sent"),
        }
    }

    fn held(e: Entry) -> Waiter {
        match e {
            Entry::Held(w) => w,
            Entry::Sent(_) => panic!("sent, expected held"),
        }
    }

    #[tokio::test]
    async fn a_saturated_engine_gets_the_shortest_virtual_finish_first() {
        let q = Arc::new(EngineQueue::default());
        let mut a = sent(q.enter(st(), 1000.0, 4000, 0, false, true));
        let _b = sent(q.enter(st(), 1000.0, 4000, 0, false, true));
        // Two sent: the next are held, each keyed by arrival + own prefill. Cold prompts at
        // t=100 (key 3,100) and 300 (3,300); warm turns at 200 (300), 2,500 (2,600) and
        // 3,250 (3,350: the cold prompts have waited their own prefill by then, they go first).
        let cold1 = held(q.enter(st(), 3000.0, 12000, 100, false, true));
        let warm1 = held(q.enter(st(), 100.0, 400, 200, false, true));
        let cold2 = held(q.enter(st(), 3000.0, 12000, 300, false, true));
        let warm2 = held(q.enter(st(), 100.0, 400, 2500, false, true));
        let warm3 = held(q.enter(st(), 100.0, 400, 3250, false, true));
        assert_eq!(q.held(), 5);
        let wait = |w: Waiter| async move {
            tokio::time::timeout(Duration::from_secs(5), w.sent())
                .await
                .expect("sent in key order")
        };
        a.release();
        let mut w1 = wait(warm1).await;
        assert_eq!(
            w1.ahead_tokens, 4000,
            "one request was still sent ahead of it"
        );
        assert_eq!(q.held(), 4);
        w1.release();
        let mut w2 = wait(warm2).await;
        w2.release();
        let mut c1 = wait(cold1).await;
        c1.release();
        let mut c2 = wait(cold2).await;
        c2.release();
        let w3 = wait(warm3).await;
        drop(w3);
        assert_eq!(q.held(), 0);
        drop(_b);
        assert_eq!(q.sent(), 0, "every slot given back");
    }

    #[tokio::test]
    async fn nothing_is_held_below_the_depth_or_the_queued_floor_and_leaving_frees_the_place() {
        let q = Arc::new(EngineQueue::default());
        let floor = Settings {
            hold: true,
            scope: Scope::Instance,
            depth: 2,
            min_queued_ms: 250.0,
        };
        // Short prompts: two sent are only 200 ms of prefill, below the floor: a third goes.
        let a = sent(q.enter(floor, 100.0, 400, 0, false, true));
        let b = sent(q.enter(floor, 100.0, 400, 0, false, true));
        let c = sent(q.enter(floor, 100.0, 400, 0, false, true));
        assert_eq!(q.sent(), 3);
        let w = held(q.enter(floor, 100.0, 400, 0, false, true));
        // A waiter that leaves takes itself out; one sent while leaving gives its place on.
        drop(w);
        assert_eq!(q.held(), 0);
        let w2 = held(q.enter(floor, 100.0, 400, 0, false, true));
        let w3 = held(q.enter(floor, 100.0, 400, 1, false, true));
        drop(a); // w2 is sent...
        drop(w2); // ...and leaves before it saw it: w3 goes.
        let s3 = tokio::time::timeout(Duration::from_secs(5), w3.sent())
            .await
            .expect("the place went on");
        drop((b, c, s3));
        assert_eq!((q.sent(), q.held()), (0, 0));
        // `hold: false`: nothing is ever held.
        let off = Settings {
            hold: false,
            ..floor
        };
        let all: Vec<Slot> = (0..10)
            .map(|_| sent(q.enter(off, 1e4, 1, 0, false, true)))
            .collect();
        assert_eq!(q.sent(), 10);
        drop(all);
        assert_eq!(q.sent(), 0);
    }

    #[tokio::test]
    async fn a_warm_request_next_in_line_goes_to_the_engine_at_once() {
        let q = Arc::new(EngineQueue::default());
        let one = Settings {
            hold: true,
            scope: Scope::Instance,
            depth: 1,
            min_queued_ms: 0.0,
        };
        let a = sent(q.enter(one, 1000.0, 4000, 0, false, true));
        // Saturated, nobody held: a cold request is held, a warm one goes (and counts).
        let cold = held(q.enter(one, 2000.0, 8000, 10, false, true));
        assert_eq!(q.sent(), 1);
        // Key 20 + 100 = 120 < the cold one's 2,010: it would be sent next anyway.
        let w = sent(q.enter(one, 100.0, 400, 20, true, true));
        assert_eq!((q.sent(), w.ahead_tokens), (2, 4000));
        // A warm request whose key is above a held one's waits its turn like any.
        let late = held(q.enter(one, 100.0, 400, 2500, true, true));
        assert_eq!(q.held(), 2);
        // The held wait for the warm one too: the first token of `a` leaves `w` sent.
        drop(a);
        assert_eq!((q.sent(), q.held()), (1, 2));
        drop(w);
        let c = tokio::time::timeout(Duration::from_secs(5), cold.sent())
            .await
            .expect("the cold one next (key 2,010 < 2,600)");
        drop(c);
        let l = tokio::time::timeout(Duration::from_secs(5), late.sent())
            .await
            .expect("then the late one");
        drop(l);
        assert_eq!((q.sent(), q.held()), (0, 0));
    }

    #[tokio::test]
    async fn with_service_scope_a_saturated_instance_holds_only_while_the_fleet_is_full() {
        let q = Arc::new(EngineQueue::default());
        let svc = Settings {
            hold: true,
            scope: Scope::Service,
            depth: 1,
            min_queued_ms: 0.0,
        };
        let a = sent(q.enter(svc, 1000.0, 4000, 0, false, false));
        assert!(q.full(&svc), "one sent at depth 1: saturated");
        // Another instance has room: a cold request goes to this saturated one at once
        // (the scheduler chose it; the engine's own queue orders it).
        let b = sent(q.enter(svc, 2000.0, 8000, 10, false, false));
        // Every instance full: the next is held...
        let c = held(q.enter(svc, 2000.0, 8000, 20, false, true));
        // ...and while one is held here, so is every later one, the fleet full or not:
        // nobody overtakes the held on the way to the engine.
        let d = held(q.enter(svc, 100.0, 400, 30, false, false));
        assert_eq!((q.sent(), q.held()), (2, 2));
        drop(a);
        drop(b);
        // The smaller key first (d: 130 < c: 2,020), one at a time at depth 1.
        let sd = tokio::time::timeout(Duration::from_secs(5), d.sent())
            .await
            .expect("the short one first");
        assert_eq!((q.sent(), q.held()), (1, 1));
        drop(sd);
        let sc = tokio::time::timeout(Duration::from_secs(5), c.sent())
            .await
            .expect("then the long one");
        drop(sc);
        assert!(!q.full(&svc));
        assert_eq!((q.sent(), q.held()), (0, 0));
    }
}
