//! What the status page remembers between scrapes: the most recent finished requests (a
//! bounded ring), the counts and latencies of the current sampling interval, the sampled
//! history (about 15 minutes of points) and the last config reload.
//!
//! [`Board::record`] runs once per request from [`crate::request::complete::finish`]: no
//! lock shared by the request path. The board is [`SHARDS`] shards, each a ring of the recent
//! requests and the interval's counts behind its own mutex; a thread records into the shard
//! of its index (threads are numbered in the order they first record), so a gateway worker
//! thread takes a lock no other worker takes (up to [`SHARDS`] threads; beyond, a few share
//! one). One atomic increment orders the requests across shards. No allocation once the
//! rings' strings have grown to their usual size (each slot's buffers are reused), no
//! formatting. The readers (the status page, the sampler in [`crate::status`], which closes an
//! interval every [`SAMPLE_EVERY`] and appends a [`Point`]) lock the shards one after the
//! other and merge them.

use crate::clock::now_ms;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Finished requests kept for the "recent decisions" table.
pub const RECENT: usize = 64;
/// Sampling period of the history.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Points kept: 180 × 5 s = 15 minutes.
pub const HISTORY: usize = 180;
/// Latency samples kept per interval and shard (a uniform reservoir beyond that).
const RESERVOIR: usize = 1024;
/// Shards of the board: the request path's locks.
pub const SHARDS: usize = 16;

/// The shard the current thread records into.
fn my_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

/// One finished request, as [`crate::request::complete::finish`] knows it.
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    pub request_id: &'a str,
    /// The model the client asked for (`-` when none was read).
    pub model: &'a str,
    /// The instance that served it (`-` when none did).
    pub instance: &'a str,
    pub status: u16,
    /// Why the instance was chosen (`x-tokengate-reason`); for a request the gateway
    /// answered itself, its error.
    pub reason: &'a str,
    pub stream: bool,
    /// Whether the request was routed (had a plan); local endpoints (`/health`,
    /// `/v1/models`) are not, and their successes are not counted.
    pub routed: bool,
    pub ttft: Option<Duration>,
    pub duration: Duration,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// A slot of the ring; its strings keep their capacity from one request to the next. Also
/// a finished request as `/admin/status` shows it (`recent`).
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Slot {
    pub at_ms: u64,
    pub request_id: String,
    pub model: String,
    pub instance: String,
    pub reason: String,
    pub status: u16,
    pub stream: bool,
    pub ttft_ms: Option<f64>,
    pub duration_ms: f64,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

fn set(dst: &mut String, src: &str) {
    dst.clear();
    dst.push_str(src);
}

/// Counts and latency samples of one interval.
#[derive(Debug)]
pub struct Interval {
    pub requests: u64,
    pub ok: u64,
    pub client_errors: u64,
    pub server_errors: u64,
    pub ttft_ms: Reservoir,
    pub duration_ms: Reservoir,
}

impl Interval {
    fn new() -> Interval {
        Interval {
            requests: 0,
            ok: 0,
            client_errors: 0,
            server_errors: 0,
            ttft_ms: Reservoir::new(),
            duration_ms: Reservoir::new(),
        }
    }

    /// The shards' intervals as one.
    fn merge(parts: Vec<Interval>) -> Interval {
        let mut iv = Interval::new();
        let (mut ttft, mut dur) = (Vec::new(), Vec::new());
        for p in parts {
            iv.requests += p.requests;
            iv.ok += p.ok;
            iv.client_errors += p.client_errors;
            iv.server_errors += p.server_errors;
            ttft.push(p.ttft_ms);
            dur.push(p.duration_ms);
        }
        iv.ttft_ms = Reservoir::merge(ttft);
        iv.duration_ms = Reservoir::merge(dur);
        iv
    }
}

/// A bounded uniform sample of a stream of values (reservoir sampling).
#[derive(Debug)]
pub struct Reservoir {
    values: Vec<f32>,
    seen: u64,
    rng: u64,
}

impl Reservoir {
    fn new() -> Reservoir {
        Reservoir {
            values: Vec::new(),
            seen: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// xorshift64: cheap and good enough to pick samples.
    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn push(&mut self, v: f32) {
        self.seen += 1;
        if self.values.len() < RESERVOIR {
            self.values.push(v);
            return;
        }
        let j = (self.next_random() % self.seen) as usize;
        if j < RESERVOIR {
            self.values[j] = v;
        }
    }

    /// One sample of the union of the parts' streams: every value when no part dropped any;
    /// otherwise [`RESERVOIR`] draws, each from a part picked in proportion to the values it
    /// saw.
    fn merge(parts: Vec<Reservoir>) -> Reservoir {
        let mut out = Reservoir::new();
        out.seen = parts.iter().map(|p| p.seen).sum();
        if parts.iter().all(|p| p.seen == p.values.len() as u64) {
            out.values = parts.into_iter().flat_map(|p| p.values).collect();
            return out;
        }
        let parts: Vec<Reservoir> = parts.into_iter().filter(|p| p.seen > 0).collect();
        for _ in 0..RESERVOIR {
            let mut k = out.next_random() % out.seen;
            let p = parts
                .iter()
                .find(|p| {
                    let hit = k < p.seen;
                    k = k.saturating_sub(p.seen);
                    hit
                })
                .unwrap_or(&parts[0]);
            let i = (out.next_random() % p.values.len() as u64) as usize;
            out.values.push(p.values[i]);
        }
        out
    }

    /// The `q` quantiles (0..=1) of the sample, `None` when it is empty.
    pub fn quantiles<const N: usize>(&mut self, q: [f64; N]) -> [Option<f64>; N] {
        self.values.sort_unstable_by(f32::total_cmp);
        let n = self.values.len();
        q.map(|q| {
            (n > 0).then(|| {
                let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
                f64::from(self.values[i])
            })
        })
    }
}

/// Per service, the cumulative prefix counters at a point (tokens): prompt (index
/// estimate), ceiling, predicted, engine prompt, engine cached, the index's prediction in
/// the engines' units. The page computes hit ratios over any window from two points.
pub type PrefixCounters = [u64; 6];

/// One sampled point of the history.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Point {
    /// End of the interval (the gateway's monotonic milliseconds, as `now_ms`).
    pub t: u64,
    pub requests: u64,
    pub ok: u64,
    pub client_errors: u64,
    pub server_errors: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub duration_p50_ms: Option<f64>,
    pub duration_p95_ms: Option<f64>,
    /// Prompt and completion tokens the engines reported in the interval.
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// In flight at the end of the interval: requests, and those in their prefill phase.
    pub inflight: u64,
    pub waiting: u64,
    /// Service name → cumulative [`PrefixCounters`].
    pub prefix: Vec<(String, PrefixCounters)>,
}

/// The last config reload.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ReloadEvent {
    pub at_ms: u64,
    pub ok: bool,
    /// The first errors of a rejected file (YAML paths), empty when applied.
    pub message: String,
}

/// One shard of the request path's state.
struct Live {
    /// The shard's recent requests with their order across shards.
    ring: Vec<(u64, Slot)>,
    /// Next slot to write.
    next: usize,
    interval: Interval,
}

/// The status page's memory. Held in [`crate::shared::Shared`].
pub struct Board {
    live: [Mutex<Live>; SHARDS],
    /// The order of the recorded requests.
    seq: AtomicU64,
    history: Mutex<VecDeque<Point>>,
    reload: Mutex<Option<ReloadEvent>>,
    /// `now_ms` when the board was made (≈ process start).
    pub started_ms: u64,
}

impl Default for Board {
    fn default() -> Self {
        Self::new()
    }
}

impl Board {
    pub fn new() -> Board {
        Board {
            live: std::array::from_fn(|_| {
                Mutex::new(Live {
                    ring: Vec::new(),
                    next: 0,
                    interval: Interval::new(),
                })
            }),
            seq: AtomicU64::new(0),
            history: Mutex::new(VecDeque::with_capacity(HISTORY)),
            reload: Mutex::new(None),
            started_ms: now_ms(),
        }
    }

    /// Records a finished request (see the module docs for its cost).
    pub fn record(&self, f: &Finished<'_>) {
        if !f.routed && f.status < 400 {
            return; // /health, /v1/models: not traffic
        }
        let at_ms = now_ms();
        let dur_ms = f.duration.as_secs_f64() * 1e3;
        let ttft_ms = f.ttft.map(|t| t.as_secs_f64() * 1e3);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut live = self.live[my_shard()].lock();
        let iv = &mut live.interval;
        iv.requests += 1;
        match f.status {
            200..=399 => iv.ok += 1,
            400..=499 => iv.client_errors += 1,
            _ => iv.server_errors += 1,
        }
        if f.routed {
            iv.duration_ms.push(dur_ms as f32);
            if let (true, Some(t)) = (f.stream, ttft_ms) {
                iv.ttft_ms.push(t as f32);
            }
        }
        let i = live.next;
        live.next = (i + 1) % RECENT;
        if live.ring.len() <= i {
            live.ring.push((0, Slot::default()));
        }
        let (n, s) = &mut live.ring[i];
        *n = seq;
        s.at_ms = at_ms;
        set(&mut s.request_id, f.request_id);
        set(&mut s.model, f.model);
        set(&mut s.instance, f.instance);
        set(&mut s.reason, f.reason);
        s.status = f.status;
        s.stream = f.stream;
        s.ttft_ms = ttft_ms;
        s.duration_ms = dur_ms;
        s.prompt_tokens = f.prompt_tokens;
        s.completion_tokens = f.completion_tokens;
        s.cached_tokens = f.cached_tokens;
    }

    /// The last [`RECENT`] requests, newest first.
    pub fn recent(&self) -> Vec<Slot> {
        let mut all: Vec<(u64, Slot)> = Vec::new();
        for shard in &self.live {
            all.extend(shard.lock().ring.iter().cloned());
        }
        all.sort_unstable_by_key(|(seq, _)| std::cmp::Reverse(*seq));
        all.truncate(RECENT);
        all.into_iter().map(|(_, s)| s).collect()
    }

    /// Closes the current interval and starts a new one.
    pub fn take_interval(&self) -> Interval {
        Interval::merge(
            self.live
                .iter()
                .map(|l| std::mem::replace(&mut l.lock().interval, Interval::new()))
                .collect(),
        )
    }

    /// Appends a point, dropping the oldest beyond [`HISTORY`].
    pub fn push_point(&self, p: Point) {
        let mut h = self.history.lock();
        if h.len() == HISTORY {
            h.pop_front();
        }
        h.push_back(p);
    }

    /// The history, oldest first.
    pub fn history(&self) -> Vec<Point> {
        self.history.lock().iter().cloned().collect()
    }

    /// Records a config reload's result.
    pub fn reloaded(&self, ok: bool, message: &str) {
        let message: String = message.chars().take(600).collect();
        *self.reload.lock() = Some(ReloadEvent {
            at_ms: now_ms(),
            ok,
            message,
        });
    }

    pub fn last_reload(&self) -> Option<ReloadEvent> {
        self.reload.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fin(id: &str, status: u16, routed: bool) -> Finished<'_> {
        Finished {
            request_id: id,
            model: "m",
            instance: "a",
            status,
            reason: "least-token",
            stream: true,
            routed,
            ttft: Some(Duration::from_millis(10)),
            duration: Duration::from_millis(30),
            prompt_tokens: Some(5),
            completion_tokens: Some(7),
            cached_tokens: None,
        }
    }

    #[test]
    fn ring_keeps_the_newest_first_and_is_bounded() {
        let b = Board::new();
        let ids: Vec<String> = (0..RECENT + 5).map(|i| format!("r{i}")).collect();
        for id in &ids {
            b.record(&fin(id, 200, true));
        }
        let r = b.recent();
        assert_eq!(r.len(), RECENT);
        assert_eq!(r[0].request_id, format!("r{}", RECENT + 4));
        assert_eq!(r[RECENT - 1].request_id, "r5");
    }

    #[test]
    fn local_successes_are_not_traffic_but_rejections_are() {
        let b = Board::new();
        b.record(&fin("h", 200, false));
        b.record(&fin("x", 404, false));
        b.record(&fin("y", 502, true));
        b.record(&fin("z", 200, true));
        let mut iv = b.take_interval();
        assert_eq!(
            (iv.requests, iv.ok, iv.client_errors, iv.server_errors),
            (3, 1, 1, 1)
        );
        assert_eq!(iv.ttft_ms.quantiles([0.5]), [Some(10.0)]);
        assert_eq!(b.take_interval().requests, 0);
        assert_eq!(b.recent().len(), 3);
    }

    #[test]
    fn threads_record_into_their_shards_and_the_readers_merge_them() {
        let b = Board::new();
        let per = 50;
        let threads = SHARDS + 3;
        std::thread::scope(|sc| {
            for t in 0..threads {
                let b = &b;
                sc.spawn(move || {
                    for i in 0..per {
                        b.record(&fin(&format!("t{t}-{i}"), 200, true));
                    }
                });
            }
        });
        let mut iv = b.take_interval();
        assert_eq!(
            (iv.requests, iv.ok),
            ((threads * per) as u64, (threads * per) as u64)
        );
        assert_eq!(iv.duration_ms.quantiles([0.5]), [Some(30.0)]);
        let r = b.recent();
        assert_eq!(r.len(), RECENT);
        // One more, from here: the newest.
        b.record(&fin("last", 404, false));
        let r = b.recent();
        assert_eq!((r.len(), r[0].request_id.as_str()), (RECENT, "last"));
        // Per thread, newest first.
        for t in 0..threads {
            let mine: Vec<usize> = r
                .iter()
                .filter_map(|s| s.request_id.strip_prefix(&format!("t{t}-")))
                .map(|i| i.parse().unwrap())
                .collect();
            assert!(mine.windows(2).all(|w| w[0] > w[1]), "{mine:?}");
        }
    }

    #[test]
    fn merged_reservoirs_sample_the_union() {
        let part = |from: u32, n: u32| {
            let mut r = Reservoir::new();
            for v in from..from + n {
                r.push(v as f32);
            }
            r
        };
        // Nothing dropped: every value.
        let mut m = Reservoir::merge(vec![part(0, 10), part(10, 10), Reservoir::new()]);
        assert_eq!((m.seen, m.values.len()), (20, 20));
        assert_eq!(m.quantiles([0.5]), [Some(9.0)]);
        // 9,000 values in 0..9000 and 1,000 in 9000..10000: the median of the union is
        // ~5,000 (the two samples put together, 1,024 + 1,000 values, would say ~8,900).
        let mut m = Reservoir::merge(vec![part(0, 9000), part(9000, 1000)]);
        assert_eq!((m.seen, m.values.len()), (10_000, RESERVOIR));
        let [p50] = m.quantiles([0.5]);
        assert!((4_000.0..6_000.0).contains(&p50.unwrap()), "{p50:?}");
    }

    #[test]
    fn quantiles_and_reservoir_bound() {
        let mut r = Reservoir::new();
        for v in 1..=100 {
            r.push(v as f32);
        }
        assert_eq!(r.quantiles([0.5, 0.95]), [Some(50.0), Some(95.0)]);
        for v in 0..10_000 {
            r.push(v as f32);
        }
        assert_eq!(r.values.len(), RESERVOIR);
        assert_eq!(Reservoir::new().quantiles([0.5]), [None]);
    }

    #[test]
    fn history_is_bounded() {
        let b = Board::new();
        for t in 0..(HISTORY as u64 + 3) {
            b.push_point(Point {
                t,
                requests: 0,
                ok: 0,
                client_errors: 0,
                server_errors: 0,
                ttft_p50_ms: None,
                ttft_p95_ms: None,
                duration_p50_ms: None,
                duration_p95_ms: None,
                prompt_tokens: 0,
                completion_tokens: 0,
                inflight: 0,
                waiting: 0,
                prefix: Vec::new(),
            });
        }
        let h = b.history();
        assert_eq!(h.len(), HISTORY);
        assert_eq!(h[0].t, 3);
    }
}
