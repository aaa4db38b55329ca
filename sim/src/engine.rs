//! The scheduler: continuous batching over a shared step clock.
//!
//! One tokio task drives the whole engine. Requests wait FIFO until a running
//! slot is free and their KV blocks fit. On admission a request is prefilled:
//! prefill throughput is a shared resource, so prefills are serialized
//! (`uncached_tokens / prefill_tps` each, one after the other) while the batch
//! keeps decoding. The first token is emitted when the prefill finishes; then
//! every decode step (`decode_step_ms + decode_per_req_ms * running`) emits one
//! more token for every decoding request. All durations are divided by
//! `time_scale`. Tokens are delivered to per-request unbounded channels; a
//! closed channel cancels the request.
//!
//! With `prefill_chunk_tokens` > 0 prefill and decode share the engine's
//! compute instead (chunked prefill, as vLLM's and SGLang's mixed batches):
//! while prefill work is pending, each decode step runs its decode first —
//! the pending prefills wait that long — and then carries up to
//! `prefill_chunk_tokens` of that prefill work, which lengthens the step by
//! their prefill time. Decoding requests see their token gaps grow while
//! prompts are prefilled, and prefill slows down a little while others decode.
//!
//! With `admit_at_prefill` a waiting request is admitted only once the prefill work before
//! it has finished (vLLM's and SGLang's schedulers look a waiting request's prefix up and
//! take its blocks when they schedule it): its prefix can be evicted while it waits, as on
//! those engines. Without it (the default) it is admitted while a running slot and blocks
//! are free, and its prefix is kept for it while its prefill waits its turn.
//!
//! Prefill/decode disaggregation ([`crate::pd`]) adds two kinds of request. A
//! PD prefill ([`Submit::hold`]) is an ordinary one-token request whose KV
//! blocks stay referenced after it finished, until [`Engine::release_hold`]
//! (the decode fetched them, or nobody did in time). A PD decode
//! ([`Submit::remote_cached`]) got its prompt's KV from a prefill engine: it
//! takes its blocks (prompt + output, not cacheable here) when admitted, skips
//! the prefix lookup and the prefill, and emits its first token right away.
//!
//! A request aborted by `POST /abort_request` ([`crate::abort`]) is dropped
//! wherever it is (queued, prefilling or decoding): its blocks are freed and it
//! gets [`Ev::Aborted`]. The abort wakes the scheduler, which sweeps the queue
//! and the batch for aborted requests before it admits or steps.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{mpsc, Notify};

use crate::abort::AbortRx;
use crate::kvcache::KvCache;
use crate::{Role, SimConfig};

/// Usage of a finished request, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub prompt: u32,
    pub cached: u32,
    pub completion: u32,
}

/// Events delivered to the connection serving a request.
#[derive(Debug)]
pub(crate) enum Ev {
    /// Admitted to the running batch; `cached` prompt tokens hit the cache.
    Admitted { cached: u32 },
    /// `upto` tokens have been generated so far (streaming requests only).
    Tokens { upto: u32 },
    /// Generation finished.
    Done(Usage),
    /// The request failed after its response started (PD: the KV transfer
    /// did not complete). Never sent by the scheduler itself.
    Failed { status: u16, message: String },
    /// `POST /abort_request` ended the request before it finished: the
    /// scheduler dropped it from its queue or batch.
    Aborted,
}

pub(crate) struct Submit {
    pub hashes: Vec<u64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub stream: bool,
    /// The output length is the client's max_tokens (finish_reason "length").
    pub length_limited: bool,
    /// PD prefill: when the request finishes, keep its KV blocks referenced
    /// under this id until [`Engine::release_hold`] (the decode fetched them).
    pub hold: Option<u64>,
    /// PD decode: the prompt's KV arrived from a prefill engine. No prefix
    /// lookup and no prefill compute; the first token is emitted at admission.
    /// The value is the prefill's cached-token count, reported in the usage.
    pub remote_cached: Option<u32>,
    /// Abort signal of the request ([`crate::abort`]).
    pub abort: Option<AbortRx>,
    pub tx: mpsc::UnboundedSender<Ev>,
}

struct Req {
    hashes: Vec<u64>,
    prompt_tokens: u32,
    target: u32,
    stream: bool,
    length_limited: bool,
    chunk: u32,
    tx: mpsc::UnboundedSender<Ev>,
    arrival: Instant,
    cached: u32,
    anon: usize,
    prefill_end: Instant,
    generated: u32,
    decoding: bool,
    hold: Option<u64>,
    remote_cached: Option<u32>,
    abort: Option<AbortRx>,
}

impl Req {
    fn aborted(&self) -> bool {
        self.abort.as_ref().is_some_and(AbortRx::is_set)
    }
}

/// vLLM's TTFT histogram buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Clone, Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }
    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
    pub(crate) fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"{b:?}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{label}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{label}}} {}", self.count);
    }
}

/// Counters since start.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prompt_tokens: u64,
    /// Uncached prompt tokens actually prefilled (remote-KV requests add none).
    pub prefill_computed: u64,
    pub generation_tokens: u64,
    pub success_length: u64,
    pub success_stop: u64,
    pub aborted: u64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

/// Counters of the prefill/decode disaggregation protocols, bumped by the
/// HTTP side ([`crate::pd`]).
#[derive(Debug, Default)]
pub(crate) struct PdCounters {
    pub prefills_published: AtomicU64,
    pub transfers_sent: AtomicU64,
    pub transfers_expired: AtomicU64,
    pub transfers_received: AtomicU64,
    pub transfer_timeouts: AtomicU64,
    pub transfer_errors: AtomicU64,
    pub awaiting_kv: AtomicUsize,
}

/// A snapshot of the engine state, for tests and `GET /admin/stats`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// The engine's role in a prefill/decode-disaggregated fleet.
    pub role: Role,
    pub running: usize,
    pub waiting: usize,
    /// Fraction of KV blocks referenced by running requests.
    pub kv_usage: f64,
    /// Cacheable blocks currently held in the KV cache.
    pub cached_blocks: usize,
    pub evicted_blocks: u64,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache (vLLM `prefix_cache_hits`).
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Requests that finished generating.
    pub requests_finished: u64,
    /// Requests the scheduler dropped before they finished: their client went
    /// away, or `POST /abort_request` aborted them.
    pub requests_aborted: u64,
    /// Requests ended by `POST /abort_request`, in any phase: queued, prefilling or
    /// decoding (also counted in `requests_aborted`), a PD decode waiting for its
    /// KV, an SGLang PD prefill holding its KV for a decode.
    pub aborted_by_request: u64,
    /// Highest number of waiting requests observed.
    pub max_waiting: usize,
    /// Highest number of requests in their prefill phase at once: queued (waiting) or
    /// admitted and not yet past their prefill (no first token yet).
    pub max_prefill_phase: usize,
    /// Requests in their prefill phase now (waiting + admitted without a first token).
    pub prefill_phase: usize,
    /// Uncached prompt tokens this engine prefilled itself (its prefill work). A PD
    /// decode engine that got the KV from a prefill engine adds none.
    pub prefill_computed_tokens: u64,
    /// Largest running batch observed.
    pub max_running: usize,
    /// Longest decode step scheduled, simulated ms (`decode_step_ms + decode_per_req_ms ×
    /// running`, plus the prefill chunk it carried with `prefill_chunk_tokens`; before the
    /// time scale): the largest batch that decoded together.
    pub max_step_ms: f64,
    /// Decode steps scheduled.
    pub decode_steps: u64,
    /// Decode steps that carried a prefill chunk (`prefill_chunk_tokens` > 0 only): steps
    /// whose decoding requests waited for another request's prefill.
    pub mixed_steps: u64,
    /// PD prefill: KV published for a bootstrap room (sglang) or registered for a
    /// transfer id (vllm).
    pub pd_prefills_published: u64,
    /// PD prefill: published KV that a decode engine fetched.
    pub pd_transfers_sent: u64,
    /// PD prefill: published KV that no decode engine fetched within `pd_timeout_ms`.
    pub pd_transfers_expired: u64,
    /// PD decode: KV received from a prefill engine.
    pub pd_transfers_received: u64,
    /// PD decode: requests failed because their KV did not arrive within `pd_timeout_ms`.
    pub pd_transfer_timeouts: u64,
    /// PD decode: requests failed because the prefill refused the transfer (room already
    /// claimed, failed prefill, block ids or prompt mismatch).
    pub pd_transfer_errors: u64,
    /// PD decode: requests waiting for (or receiving) their KV now.
    pub pd_awaiting_kv: usize,
    /// PD prefill: finished prefills whose KV is pinned until a decode fetches it.
    pub pd_kv_pinned: usize,
}

struct State {
    kv: KvCache,
    waiting: VecDeque<Req>,
    running: Vec<Req>,
    /// PD prefill: KV of finished requests pinned until the decode fetched it.
    held: HashMap<u64, (Vec<u64>, usize)>,
    prefill_free_at: Instant,
    /// End of the decode part of the step under way (`prefill_chunk_tokens` > 0): a
    /// prefill admitted meanwhile starts after it.
    decode_until: Instant,
    m: Metrics,
    /// (time, cumulative generation tokens) at recent decode steps, for a
    /// generation throughput over the last second.
    gen_window: VecDeque<(Instant, u64)>,
    max_waiting: usize,
    max_prefill_phase: usize,
    max_running: usize,
    max_step_ms: f64,
    decode_steps: u64,
    mixed_steps: u64,
}

pub(crate) struct Engine {
    cfg: Arc<SimConfig>,
    state: Mutex<State>,
    notify: Notify,
    pub(crate) pd: PdCounters,
    /// An abort was signalled: the scheduler sweeps for aborted requests.
    abort_sweep: AtomicBool,
    /// See [`Stats::aborted_by_request`].
    pub(crate) aborted_by_request: AtomicU64,
}

/// What `/metrics` renders, copied out of the engine under one lock.
pub(crate) struct Snapshot {
    pub stats: Stats,
    pub m: Metrics,
    /// Generated tokens per (wall-clock) second over the last second.
    pub gen_throughput: f64,
}

/// Window of [`State::gen_window`].
const GEN_WINDOW: Duration = Duration::from_secs(1);

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

impl Engine {
    pub(crate) fn new(cfg: Arc<SimConfig>) -> Arc<Self> {
        Arc::new(Engine {
            state: Mutex::new(State {
                kv: match cfg.cache_tokens {
                    0 => KvCache::new(cfg.kv_blocks),
                    t => KvCache::with_cache_limit(cfg.kv_blocks, t / cfg.block_size),
                },
                waiting: VecDeque::new(),
                running: Vec::new(),
                held: HashMap::new(),
                prefill_free_at: Instant::now(),
                decode_until: Instant::now(),
                gen_window: VecDeque::new(),
                m: Metrics {
                    prefix_queries: 0,
                    prefix_hits: 0,
                    prompt_tokens: 0,
                    prefill_computed: 0,
                    generation_tokens: 0,
                    success_length: 0,
                    success_stop: 0,
                    aborted: 0,
                    ttft: Histogram::new(TTFT_BUCKETS),
                    e2e: Histogram::new(E2E_BUCKETS),
                },
                max_waiting: 0,
                max_prefill_phase: 0,
                max_running: 0,
                max_step_ms: 0.0,
                decode_steps: 0,
                mixed_steps: 0,
            }),
            cfg,
            notify: Notify::new(),
            pd: PdCounters::default(),
            abort_sweep: AtomicBool::new(false),
            aborted_by_request: AtomicU64::new(0),
        })
    }

    /// Total KV blocks a request needs while running.
    pub(crate) fn blocks_needed(&self, prompt_tokens: usize, output_tokens: usize) -> usize {
        (prompt_tokens + output_tokens).div_ceil(self.cfg.block_size)
    }

    pub(crate) fn submit(&self, s: Submit) {
        let now = Instant::now();
        {
            let mut st = self.state.lock();
            // Aborted before it got here: the next sweep drops it. (An abort
            // signalled after this check finds the request queued.)
            if s.abort.as_ref().is_some_and(AbortRx::is_set) {
                self.abort_sweep.store(true, Ordering::SeqCst);
            }
            st.waiting.push_back(Req {
                hashes: s.hashes,
                prompt_tokens: s.prompt_tokens,
                target: s.output_tokens.max(1),
                stream: s.stream,
                length_limited: s.length_limited,
                chunk: self.cfg.chunk_tokens.max(1) as u32,
                tx: s.tx,
                arrival: now,
                cached: 0,
                anon: 0,
                prefill_end: now,
                generated: 0,
                decoding: false,
                hold: s.hold,
                remote_cached: s.remote_cached,
                abort: s.abort,
            });
            let w = st.waiting.len();
            st.max_waiting = st.max_waiting.max(w);
            // A request enters its prefill phase only here: the peak is reached here.
            let p = w + st.running.iter().filter(|r| !r.decoding).count();
            st.max_prefill_phase = st.max_prefill_phase.max(p);
        }
        self.notify.notify_one();
    }

    /// `POST /abort_request` signalled some requests: wake the scheduler to drop
    /// those it holds.
    pub(crate) fn abort_signalled(&self) {
        self.abort_sweep.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    pub(crate) fn reset_prefix_cache(&self) {
        self.state.lock().kv.reset();
    }

    /// Release the KV pinned under `id` by a PD prefill ([`Submit::hold`]).
    pub(crate) fn release_hold(&self, id: u64) {
        let released = {
            let mut st = self.state.lock();
            match st.held.remove(&id) {
                Some((hashes, anon)) => {
                    st.kv.release(&hashes, anon);
                    true
                }
                None => false,
            }
        };
        if released {
            // a waiting request may fit now
            self.notify.notify_one();
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let st = self.state.lock();
        self.stats_locked(&st)
    }

    fn stats_locked(&self, st: &State) -> Stats {
        let pd = &self.pd;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            role: self.cfg.role,
            running: st.running.len(),
            waiting: st.waiting.len(),
            kv_usage: st.kv.usage(),
            cached_blocks: st.kv.cached_blocks(),
            evicted_blocks: st.kv.evictions(),
            prefix_cache_queries: st.m.prefix_queries,
            prefix_cache_hits: st.m.prefix_hits,
            prompt_tokens: st.m.prompt_tokens,
            generation_tokens: st.m.generation_tokens,
            requests_finished: st.m.success_length + st.m.success_stop,
            requests_aborted: st.m.aborted,
            aborted_by_request: get(&self.aborted_by_request),
            max_waiting: st.max_waiting,
            max_prefill_phase: st.max_prefill_phase,
            prefill_phase: st.waiting.len() + st.running.iter().filter(|r| !r.decoding).count(),
            prefill_computed_tokens: st.m.prefill_computed,
            max_running: st.max_running,
            max_step_ms: st.max_step_ms,
            decode_steps: st.decode_steps,
            mixed_steps: st.mixed_steps,
            pd_prefills_published: get(&pd.prefills_published),
            pd_transfers_sent: get(&pd.transfers_sent),
            pd_transfers_expired: get(&pd.transfers_expired),
            pd_transfers_received: get(&pd.transfers_received),
            pd_transfer_timeouts: get(&pd.transfer_timeouts),
            pd_transfer_errors: get(&pd.transfer_errors),
            pd_awaiting_kv: pd.awaiting_kv.load(Ordering::Relaxed),
            pd_kv_pinned: st.held.len(),
        }
    }

    /// Everything `/metrics` shows, taken under one lock.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut st = self.state.lock();
        let now = Instant::now();
        while st
            .gen_window
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > GEN_WINDOW)
        {
            st.gen_window.pop_front();
        }
        let gen_throughput = match (st.gen_window.front(), st.gen_window.back()) {
            (Some((t0, g0)), Some((t1, g1))) if t1 > t0 => {
                (g1 - g0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        };
        Snapshot {
            stats: self.stats_locked(&st),
            m: st.m.clone(),
            gen_throughput,
        }
    }

    fn step_duration(&self, running: usize) -> Duration {
        let c = &self.cfg;
        secs((c.decode_step_ms + c.decode_per_req_ms * running as f64) / 1000.0 / c.time_scale)
    }

    /// The scheduler loop; runs until aborted.
    pub(crate) async fn run(self: Arc<Self>) {
        let sleep = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(sleep);
        let mut step_deadline: Option<Instant> = None;
        let mut last_step: Option<Instant> = None;
        let slack = Duration::from_millis(5);
        loop {
            let wake = {
                let mut st = self.state.lock();
                let now = Instant::now();
                if self.abort_sweep.swap(false, Ordering::SeqCst) {
                    let n = st.drop_aborted();
                    self.aborted_by_request
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
                if let Some(d) = step_deadline {
                    if d <= now {
                        st.decode_step(now);
                        step_deadline = None;
                        last_step = Some(d);
                        let g = st.m.generation_tokens;
                        st.gen_window.push_back((now, g));
                        while st
                            .gen_window
                            .front()
                            .is_some_and(|(t, _)| now.duration_since(*t) > GEN_WINDOW)
                        {
                            st.gen_window.pop_front();
                        }
                    }
                }
                st.finish_prefills(now);
                st.admit(now, &self.cfg);
                st.max_running = st.max_running.max(st.running.len());
                if step_deadline.is_none() && st.running.iter().any(|r| r.decoding) {
                    let c = &self.cfg;
                    let base = match last_step {
                        Some(l) if l + slack >= now => l,
                        _ => now,
                    };
                    let decode = self.step_duration(st.running.len());
                    let chunk = st.share_step(base, decode, c);
                    let ms = c.decode_step_ms
                        + c.decode_per_req_ms * st.running.len() as f64
                        + chunk.as_secs_f64() * 1000.0 * c.time_scale;
                    st.max_step_ms = st.max_step_ms.max(ms);
                    step_deadline = Some(base + decode + chunk);
                }
                let mut prefill = st
                    .running
                    .iter()
                    .filter(|r| !r.decoding)
                    .map(|r| r.prefill_end)
                    .min();
                if self.cfg.admit_at_prefill && !st.waiting.is_empty() && st.prefill_free_at > now {
                    // The next admission waits for the prefill before it (whose request may
                    // have been aborted since). Waiting for blocks or a slot instead, it
                    // wakes with the steps, as without the option.
                    let free = st.prefill_free_at;
                    prefill = Some(prefill.map_or(free, |p| p.min(free)));
                }
                match (step_deadline, prefill) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            };
            match wake {
                Some(t) if t <= Instant::now() => tokio::task::yield_now().await,
                Some(t) => {
                    sleep.as_mut().reset(t.into());
                    tokio::select! {
                        _ = &mut sleep => {}
                        _ = self.notify.notified() => {}
                    }
                }
                None => self.notify.notified().await,
            }
        }
    }
}

impl State {
    /// Shared compute (`prefill_chunk_tokens` > 0) for the decode step starting at `base`:
    /// the step decodes first (`decode`), so pending prefill work moves back by that much,
    /// then it carries up to one chunk of that work. Returns the chunk's duration, zero
    /// without pending prefill work or with the mode off.
    fn share_step(&mut self, base: Instant, decode: Duration, cfg: &SimConfig) -> Duration {
        self.decode_steps += 1;
        if cfg.prefill_chunk_tokens == 0 {
            return Duration::ZERO;
        }
        self.decode_until = base + decode;
        if self.prefill_free_at <= base {
            return Duration::ZERO;
        }
        for r in self.running.iter_mut() {
            if !r.decoding && r.prefill_end > base {
                r.prefill_end += decode;
            }
        }
        self.prefill_free_at += decode;
        self.mixed_steps += 1;
        let chunk = secs(cfg.prefill_chunk_tokens as f64 / cfg.prefill_tps / cfg.time_scale);
        chunk.min(self.prefill_free_at - self.decode_until)
    }

    /// Drop the aborted requests from the queue and the batch (freeing their
    /// blocks) and tell them; returns how many.
    fn drop_aborted(&mut self) -> usize {
        let State {
            waiting,
            running,
            kv,
            m,
            ..
        } = self;
        let before = waiting.len() + running.len();
        waiting.retain(|r| {
            if !r.aborted() {
                return true;
            }
            let _ = r.tx.send(Ev::Aborted);
            false
        });
        running.retain(|r| {
            if !r.aborted() {
                return true;
            }
            kv.release(&r.hashes, r.anon);
            let _ = r.tx.send(Ev::Aborted);
            false
        });
        let n = before - waiting.len() - running.len();
        m.aborted += n as u64;
        n
    }

    fn admit(&mut self, now: Instant, cfg: &SimConfig) {
        let bs = cfg.block_size;
        while self.running.len() < cfg.max_running {
            let Some(front) = self.waiting.front() else {
                break;
            };
            if front.tx.is_closed() {
                self.waiting.pop_front();
                self.m.aborted += 1;
                continue;
            }
            // vLLM and SGLang look a waiting request's prefix up (and take its blocks)
            // when they schedule its prefill, not when it arrives.
            if cfg.admit_at_prefill && front.remote_cached.is_none() && self.prefill_free_at > now {
                break;
            }
            let prompt = front.prompt_tokens as usize;
            let total = (prompt + front.target as usize).div_ceil(bs);
            if let Some(cached) = front.remote_cached {
                // PD decode: the prompt's KV came from the prefill engine; it
                // occupies blocks here, but nothing is looked up or computed.
                if self.kv.allocate(&[], 0, total).is_none() {
                    break;
                }
                let mut r = self.waiting.pop_front().expect("front exists");
                r.hashes = Vec::new();
                r.anon = total;
                r.cached = cached;
                r.prefill_end = now;
                self.m.prompt_tokens += prompt as u64;
                let _ = r.tx.send(Ev::Admitted { cached: r.cached });
                self.running.push(r);
                continue;
            }
            // vLLM always recomputes the last prompt token.
            let max_hit = (prompt - 1) / bs;
            let anon = total.saturating_sub(front.hashes.len());
            let Some(hit) = self.kv.allocate(&front.hashes, max_hit, anon) else {
                break;
            };
            let mut r = self.waiting.pop_front().expect("front exists");
            r.cached = (hit * bs) as u32;
            r.anon = anon;
            let uncached = prompt - hit * bs;
            let start = self.prefill_free_at.max(now).max(self.decode_until);
            r.prefill_end = start + secs(uncached as f64 / cfg.prefill_tps / cfg.time_scale);
            self.prefill_free_at = r.prefill_end;
            self.m.prefix_queries += prompt as u64;
            self.m.prefix_hits += r.cached as u64;
            self.m.prompt_tokens += prompt as u64;
            self.m.prefill_computed += uncached as u64;
            let _ = r.tx.send(Ev::Admitted { cached: r.cached });
            self.running.push(r);
        }
    }

    fn finish_prefills(&mut self, now: Instant) {
        let State {
            running,
            kv,
            m,
            held,
            ..
        } = self;
        running.retain_mut(|r| {
            if r.decoding || r.prefill_end > now {
                return true;
            }
            r.decoding = true;
            m.ttft.observe(now.duration_since(r.arrival).as_secs_f64());
            emit(r, kv, held, m, now)
        });
    }

    fn decode_step(&mut self, now: Instant) {
        let State {
            running,
            kv,
            m,
            held,
            ..
        } = self;
        running.retain_mut(|r| !r.decoding || emit(r, kv, held, m, now));
    }
}

/// Produce one token for `r`; returns false when the request left the batch.
fn emit(
    r: &mut Req,
    kv: &mut KvCache,
    held: &mut HashMap<u64, (Vec<u64>, usize)>,
    m: &mut Metrics,
    now: Instant,
) -> bool {
    r.generated += 1;
    m.generation_tokens += 1;
    let done = r.generated >= r.target;
    let alive = if r.stream {
        if done || r.generated.is_multiple_of(r.chunk) {
            r.tx.send(Ev::Tokens { upto: r.generated }).is_ok()
        } else {
            !r.tx.is_closed()
        }
    } else {
        !r.tx.is_closed()
    };
    if !alive {
        kv.release(&r.hashes, r.anon);
        m.aborted += 1;
        return false;
    }
    if done {
        match r.hold {
            // PD prefill: the KV stays referenced until the decode fetched it.
            Some(id) => {
                held.insert(id, (std::mem::take(&mut r.hashes), r.anon));
            }
            None => kv.release(&r.hashes, r.anon),
        }
        if r.length_limited {
            m.success_length += 1;
        } else {
            m.success_stop += 1;
        }
        m.e2e.observe(now.duration_since(r.arrival).as_secs_f64());
        let _ = r.tx.send(Ev::Done(Usage {
            prompt: r.prompt_tokens,
            cached: r.cached,
            completion: r.generated,
        }));
        return false;
    }
    true
}
