//! What the status page remembers between scrapes: the most recent finished requests (a
//! bounded ring), the counts and latencies of the current sampling interval, the sampled
//! history (about 15 minutes of points) and the last config reload.
//!
//! [`Board::record`] runs once per request from [`crate::request::complete::finish`]: one
//! mutex, no allocation once the ring's strings have grown to their usual size (each slot's
//! buffers are reused), no formatting. The sampler in [`crate::status`] closes an interval
//! every [`SAMPLE_EVERY`] and appends a [`Point`].

use crate::clock::now_ms;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::time::Duration;

/// Finished requests kept for the "recent decisions" table.
pub const RECENT: usize = 64;
/// Sampling period of the history.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Points kept: 180 × 5 s = 15 minutes.
pub const HISTORY: usize = 180;
/// Latency samples kept per interval (a uniform reservoir beyond that).
const RESERVOIR: usize = 1024;

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

/// A slot of the ring; its strings keep their capacity from one request to the next.
#[derive(Debug, Default, Clone)]
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

    fn push(&mut self, v: f32) {
        self.seen += 1;
        if self.values.len() < RESERVOIR {
            self.values.push(v);
            return;
        }
        // xorshift64: cheap and good enough to pick which sample to replace.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let j = (self.rng % self.seen) as usize;
        if j < RESERVOIR {
            self.values[j] = v;
        }
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
/// estimate), ceiling, predicted, engine prompt, engine cached. The page computes hit
/// ratios over any window from two points.
pub type PrefixCounters = [u64; 5];

/// One sampled point of the history.
#[derive(Debug, Clone, serde::Serialize)]
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
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadEvent {
    pub at_ms: u64,
    pub ok: bool,
    /// The first errors of a rejected file (YAML paths), empty when applied.
    pub message: String,
}

struct Live {
    ring: Vec<Slot>,
    /// Next slot to write.
    next: usize,
    interval: Interval,
}

/// The status page's memory. Held in [`crate::shared::Shared`].
pub struct Board {
    live: Mutex<Live>,
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
            live: Mutex::new(Live {
                ring: Vec::with_capacity(RECENT),
                next: 0,
                interval: Interval::new(),
            }),
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
        let mut live = self.live.lock();
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
            live.ring.push(Slot::default());
        }
        let s = &mut live.ring[i];
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

    /// The ring, newest first.
    pub fn recent(&self) -> Vec<Slot> {
        let live = self.live.lock();
        let n = live.ring.len();
        (0..n)
            .map(|k| live.ring[(live.next + n - 1 - k) % n].clone())
            .collect()
    }

    /// Closes the current interval and starts a new one.
    pub fn take_interval(&self) -> Interval {
        std::mem::replace(&mut self.live.lock().interval, Interval::new())
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
    // Not `super::*`: the module graph test reads that as a use of `status`, which uses
    // `shared`, which holds this module's `Board`.
    use crate::status::recent::*;

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
