//! The queue of a saturated engine, kept at the gateway and served shortest predicted work
//! first (`services[].engine_queue: {hold: true}`; off by default).
//!
//! An engine serves its waiting requests in arrival order (vLLM's and SGLang's default
//! scheduling, engine-sim's): a warm turn whose few hundred uncached tokens take 0.2 s waits
//! behind every cold 4k-token prompt sent before it. Once an instance has `depth` requests
//! sent and waiting for their first token, and their predicted prefill is at least
//! `min_queued`, the gateway sends it no more; the requests the scheduler placed there wait
//! here instead, each with its key `arrival + own prefill` (predicted at that instance: its
//! uncached tokens at the instance's learned rate), and whenever one of the sent requests
//! gets its first token (or fails, or leaves) the waiter with the smallest key is sent.
//!
//! The key is a virtual finish time: a short request overtakes a long one that arrived less
//! than the long one's own prefill before it, so a long prompt is delayed by the short work
//! arriving during its own prefill (about utilization × its own prefill), never starved. The
//! placement stands — the scheduler chose the instance at arrival and the request's load
//! counts there while it waits, so the queue figures the scheduler compares are the same —,
//! only the order in which the engine receives its queue changes; except that when another
//! instance of the service gets room with nobody held there, it signals the service
//! ([`EngineQueue::enter`]'s `fleet`) and a held request whose wait ([`Probe::wait_ms`])
//! costs more than starting there moves ([`EngineQueue::claim`]; the rule is the caller's,
//! `request::slot`). Below saturation nothing is held: with fewer than `depth` sent, or less
//! than `min_queued` of predicted prefill sent, a request goes at once (an engine that
//! batches prefills keeps a batch's worth).
//!
//! Only streamed requests go through it (the caller's choice): a non-stream answer's first
//! token is its last, so its slot would be held through its whole decode.
//!
//! Off by default: in the workload matrix (`bench/results/matrix.md`, run 6) it took the
//! overloaded cell's p50 down by 14-23 % per seed and raised p99 in three cells of twelve (the long
//! prompts it lets others overtake are the tail), a trade, not a default.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// When an instance's queue is held (resolved `services[].engine_queue`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Hold requests at all (`hold: false`: every request is sent at once).
    pub hold: bool,
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
            hold: false,
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
    /// The service's signal that one of its instances has room and nobody held (the last
    /// request that entered gave it): requests held elsewhere may move here ([`Probe::wait_ms`]).
    fleet: Option<Arc<Notify>>,
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
        let s = &self.settings;
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
        if self.settings.hold && self.held.is_empty() && self.has_room() {
            if let Some(f) = &self.fleet {
                f.notify_waiters();
            }
        }
    }

    /// The predicted prefill ahead of held request `id` and its own, ms (`None`: not held).
    fn wait_ms(&self, id: u64) -> Option<f64> {
        let me = self.held.iter().find(|h| h.id == id)?;
        let ahead: f64 = self
            .held
            .iter()
            .filter(|h| h.key.total_cmp(&me.key).then(h.id.cmp(&id)).is_lt())
            .map(|h| h.own_ms)
            .sum();
        Some(self.sent_ms + ahead + me.own_ms)
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

    /// Its place here, to ask while it waits ([`Probe::wait_ms`]).
    pub fn probe(&self) -> Probe {
        Probe {
            queue: self.queue.clone(),
            id: self.id,
            since: self.since,
        }
    }
}

/// A held request's place, asked while [`Waiter::sent`] waits.
#[derive(Debug)]
pub struct Probe {
    queue: Arc<EngineQueue>,
    id: u64,
    since: std::time::Instant,
}

impl Probe {
    /// What the request waits for here from now, ms: the predicted prefill sent ahead of it,
    /// that of the held requests whose turn comes first, and its own (`None`: it was sent).
    pub fn wait_ms(&self) -> Option<f64> {
        self.queue.inner.lock().wait_ms(self.id)
    }

    /// How long it has been held.
    pub fn held_for(&self) -> Duration {
        self.since.elapsed()
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

/// A prediction as a duration in ms (0 when it is not a finite positive number).
fn finite(ms: f64) -> f64 {
    if ms.is_finite() {
        ms.max(0.0)
    } else {
        0.0
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
    /// `now_ms`: sent at once when the instance has room and nobody is held, else held with
    /// the key `now_ms + own_ms`.
    /// `fleet` is the service's signal that one of its instances has room and nobody held.
    pub fn enter(
        self: &Arc<Self>,
        st: Settings,
        own_ms: f64,
        tokens: u64,
        now_ms: u64,
        fleet: &Arc<Notify>,
    ) -> Entry {
        let own_ms = finite(own_ms);
        let mut q = self.inner.lock();
        let changed = q.settings != st;
        q.settings = st;
        if !q.fleet.as_ref().is_some_and(|f| Arc::ptr_eq(f, fleet)) {
            q.fleet = Some(fleet.clone());
        }
        if changed {
            // Looser settings (a reload): the held may go now.
            q.pump();
        }
        if let Some(slot) = self.send_now(&mut q, own_ms, tokens) {
            return Entry::Sent(slot);
        }
        q.next_id += 1;
        let id = q.next_id;
        let wake = Arc::new(Notify::new());
        let granted = Arc::new(AtomicBool::new(false));
        let ahead = Arc::new(Mutex::new(0));
        let key = now_ms as f64 + own_ms;
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

    /// Sent at once when the instance has room and nobody is held.
    fn send_now(self: &Arc<Self>, q: &mut Inner, own_ms: f64, tokens: u64) -> Option<Slot> {
        if !(q.held.is_empty() && q.has_room()) {
            return None;
        }
        let ahead = q.sent_tokens;
        q.send(own_ms, tokens);
        Some(Slot {
            queue: self.clone(),
            own_ms,
            tokens,
            ahead_tokens: ahead,
            held: Duration::ZERO,
            live: true,
        })
    }

    /// The predicted prefill sent here, ms, when the instance has room and nobody is held
    /// (a request held elsewhere may move here), else `None`.
    pub fn room(&self) -> Option<f64> {
        let q = self.inner.lock();
        (q.settings.hold && q.held.is_empty() && q.has_room()).then_some(q.sent_ms)
    }

    /// A request held elsewhere moves here: sent at once if there is still room and nobody
    /// held (else `None`: another took the room first). `held` is how long it was held.
    pub fn claim(self: &Arc<Self>, own_ms: f64, tokens: u64, held: Duration) -> Option<Slot> {
        let mut q = self.inner.lock();
        if !q.settings.hold {
            return None;
        }
        let mut slot = self.send_now(&mut q, finite(own_ms), tokens)?;
        slot.held = held;
        Some(slot)
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
        let fl = Arc::new(Notify::new());
        let mut a = sent(q.enter(st(), 1000.0, 4000, 0, &fl));
        let _b = sent(q.enter(st(), 1000.0, 4000, 0, &fl));
        // Two sent: the next are held, each keyed by arrival + own prefill. Cold prompts at
        // t=100 (key 3,100) and 300 (3,300); warm turns at 200 (300), 2,500 (2,600) and
        // 3,250 (3,350: the cold prompts have waited their own prefill by then, they go first).
        let cold1 = held(q.enter(st(), 3000.0, 12000, 100, &fl));
        let warm1 = held(q.enter(st(), 100.0, 400, 200, &fl));
        let cold2 = held(q.enter(st(), 3000.0, 12000, 300, &fl));
        let warm2 = held(q.enter(st(), 100.0, 400, 2500, &fl));
        let warm3 = held(q.enter(st(), 100.0, 400, 3250, &fl));
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
        let fl = Arc::new(Notify::new());
        let floor = Settings {
            hold: true,
            depth: 2,
            min_queued_ms: 250.0,
        };
        // Short prompts: two sent are only 200 ms of prefill, below the floor: a third goes.
        let a = sent(q.enter(floor, 100.0, 400, 0, &fl));
        let b = sent(q.enter(floor, 100.0, 400, 0, &fl));
        let c = sent(q.enter(floor, 100.0, 400, 0, &fl));
        assert_eq!(q.sent(), 3);
        let w = held(q.enter(floor, 100.0, 400, 0, &fl));
        // A waiter that leaves takes itself out; one sent while leaving gives its place on.
        drop(w);
        assert_eq!(q.held(), 0);
        let w2 = held(q.enter(floor, 100.0, 400, 0, &fl));
        let w3 = held(q.enter(floor, 100.0, 400, 1, &fl));
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
            .map(|_| sent(q.enter(off, 1e4, 1, 0, &fl)))
            .collect();
        assert_eq!(q.sent(), 10);
        drop(all);
        assert_eq!(q.sent(), 0);
    }

    #[tokio::test]
    async fn an_instance_that_frees_with_nobody_held_signals_and_a_held_request_may_move_there() {
        let one = Settings {
            hold: true,
            depth: 1,
            min_queued_ms: 0.0,
        };
        let fl = Arc::new(Notify::new());
        let (a, b) = (
            Arc::new(EngineQueue::default()),
            Arc::new(EngineQueue::default()),
        );
        // A: one sent (1 s predicted), two held; what each still waits for there.
        let sent_a = sent(a.enter(one, 1000.0, 4000, 0, &fl));
        let w1 = held(a.enter(one, 500.0, 2000, 10, &fl));
        let w2 = held(a.enter(one, 300.0, 1200, 300, &fl));
        let (p1, p2) = (w1.probe(), w2.probe());
        assert_eq!(p1.wait_ms(), Some(1500.0));
        assert_eq!(p2.wait_ms(), Some(1800.0), "behind the sent one and w1");
        // B: busy, no room; its first token frees it with nobody held: the service hears it.
        let sent_b = sent(b.enter(one, 800.0, 3000, 0, &fl));
        assert_eq!(b.room(), None);
        let signal = fl.notified();
        tokio::pin!(signal);
        signal.as_mut().enable();
        drop(sent_b);
        tokio::time::timeout(Duration::from_secs(5), signal)
            .await
            .expect("a freed instance signals");
        assert_eq!(b.room(), Some(0.0));
        // w2 moves: B's place is taken at once (a second claim finds none), it leaves A.
        let moved = b
            .claim(600.0, 1200, Duration::from_millis(7))
            .expect("room");
        assert_eq!(
            (moved.held, moved.ahead_tokens),
            (Duration::from_millis(7), 0)
        );
        assert!(b.claim(10.0, 10, Duration::ZERO).is_none(), "taken");
        drop(w2);
        assert_eq!((a.held(), p2.wait_ms()), (1, None));
        // A's own turn order is unchanged: w1 goes at the first token there.
        drop(sent_a);
        let s1 = tokio::time::timeout(Duration::from_secs(5), w1.sent())
            .await
            .expect("sent");
        assert_eq!(p1.wait_ms(), None, "sent");
        // Nothing held: a queue that never held (or `hold: false`) offers no room to move to.
        assert_eq!(EngineQueue::default().room(), None);
        drop((s1, moved));
        assert_eq!((a.sent(), b.sent(), a.held()), (0, 0, 0));
    }
}
