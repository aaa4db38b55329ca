//! Predicted time to first token: what it would cost a request to go to each candidate.
//!
//! For candidate `i`:
//!
//! ```text
//!   est_i = (Q_i + E_i + U_i) / R_i  +  P · U_i / R_i  +  D_i
//! ```
//!
//! * `Q_i` — prefill work already queued there by this gateway: the uncached prompt tokens of
//!   the requests dispatched to `i` that have no first token yet ([`Candidate::prefill_tokens`]).
//! * `E_i` — work queued in the engine that this gateway did not send (when the gateway scrapes
//!   the engines' metrics, [`Candidate::engine`]): `max(0, engine waiting − our waiting)` ×
//!   the mean uncached tokens per request (this request's prompt before any is known).
//! * `U_i` — this request's uncached tokens there: its prompt minus the prefix `i` holds
//!   ([`RequestView::uncached_tokens`]).
//! * `R_i` — `i`'s prefill rate, tokens per second, learned online (an EWMA) from the requests
//!   it served: the uncached tokens (as the engine reported them) of each completed request
//!   that found nothing queued ahead of it, over its observed prefill time (dispatch → first
//!   token, minus one decode step). Before an instance has `min_samples` such requests, the
//!   mean rate of the instances that have, else the configured prior — so a new or restarted
//!   instance is not starved by a pessimistic guess.
//! * `D_i` — decode interference: one decode step of `i`'s running batch, learned the same way
//!   from streams' time per output token. The first token waits for it.
//! * `P` — `miss_penalty`: uncached tokens cost more than their own prefill time, because
//!   computing them on an instance that does not hold the prefix also pushes other prefixes
//!   out of its cache (0 = pure TTFT).
//!
//! The model is the gateway's (every dispatched request teaches it, whatever the scheduler);
//! stages and scorers only read it. Pure: the caller passes the clock.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::RwLock;

use crate::candidate::{Candidate, RequestView};
use crate::hash::InstanceKey;

/// Settings of the cost model.
#[derive(Clone, Debug, PartialEq)]
pub struct CostConfig {
    /// Prefill rate assumed before anything is learned (tokens/s). Default 8 000.
    pub prior_prefill_tps: f64,
    /// Decode step assumed before anything is learned (ms). Default 20.
    pub prior_step_ms: f64,
    /// Weight of a new observation in the moving averages (0..1]. Default 0.2.
    pub alpha: f64,
    /// Samples before an instance's own rate is trusted over the fleet's. Default 3. (1 was
    /// tried in the matrix's run 9: with mixed GPU generations the half-speed engines then
    /// looked slow from their first prefill and the fast ones took the work and thrashed their
    /// small caches — `many-4k-agents-fifth-high-mixed-chunked` lost 2–6 cached points on
    /// each of seeds 1–3.)
    pub min_samples: u32,
    /// Extra cost of uncached tokens, as a fraction of their prefill time. Default 0.
    pub miss_penalty: f64,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            prior_prefill_tps: 8000.0,
            prior_step_ms: 20.0,
            alpha: 0.2,
            min_samples: 3,
            miss_penalty: 0.0,
        }
    }
}

impl CostConfig {
    /// The fleet's prefill rate for an instance without `min_samples` of its own: the mean
    /// of `learned`'s instances that have them, else the prior.
    fn fleet_rate<'a>(&self, learned: impl Iterator<Item = &'a Learned>) -> (f64, RateFrom) {
        let (sum, n) = learned
            .filter(|l| l.prefill_samples >= self.min_samples)
            .fold((0.0, 0u32), |(s, n), l| (s + l.prefill_tps, n + 1));
        if n > 0 {
            (sum / f64::from(n), RateFrom::Fleet)
        } else {
            (self.prior_prefill_tps, RateFrom::Prior)
        }
    }

    /// An instance's prefill rate, tokens/s (at least 1): its own once it has `min_samples`,
    /// else `fleet` ([`Self::fleet_rate`]).
    fn rate(&self, l: Option<&Learned>, fleet: (f64, RateFrom)) -> (f64, RateFrom) {
        let (tps, from) = match l.filter(|l| l.prefill_samples >= self.min_samples) {
            Some(l) => (l.prefill_tps, RateFrom::Own),
            None => fleet,
        };
        (tps.max(1.0), from)
    }
}

/// Whether a request is *warm* where `cached_tokens` of its `prompt_tokens` are held: at
/// least half of it cached. The follow term counts warm decisions ([`CostModel::routed`]);
/// the engine queue sends a warm request that is next in line at once.
pub fn warm(prompt_tokens: u64, cached_tokens: u64) -> bool {
    cached_tokens > 0 && cached_tokens.saturating_mul(2) >= prompt_tokens
}

/// What one instance taught the model so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Learned {
    /// Prefill tokens per second (EWMA), 0 before the first sample.
    pub prefill_tps: f64,
    pub prefill_samples: u32,
    /// One decode step, ms (EWMA), 0 before the first sample.
    pub step_ms: f64,
    pub step_samples: u32,
}

/// A completed request, as the cost model learns from it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// Prefill tokens queued on the instance ahead of the request when it was dispatched.
    pub queued_tokens: u64,
    /// The request's own uncached prompt tokens (what the engine reported, when it did).
    pub uncached_tokens: u64,
    /// Dispatch → first token, ms.
    pub ttft_ms: f64,
    /// Time per output token after the first, ms (streams with several tokens).
    pub tpot_ms: Option<f64>,
}

/// Where an estimate's prefill rate comes from ([`Estimate::tps_from`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RateFrom {
    /// The instance's own samples (requests with nothing queued ahead of them).
    #[default]
    Own,
    /// The mean of the instances that have their own: this one has too few samples — a new
    /// instance, or one that never found its queue empty (a saturated engine teaches no
    /// rate), which on engines of mixed speed may be far from its own.
    Fleet,
    /// `prior_prefill_tps`: no instance has its own yet.
    Prior,
}
impl RateFrom {
    /// The explanation's suffix after the rate (`@1.1k/s fleet`).
    fn suffix(self) -> &'static str {
        match self {
            RateFrom::Own => "",
            RateFrom::Fleet => " fleet",
            RateFrom::Prior => " prior",
        }
    }
}

/// One candidate's estimate and its parts (for the explanation).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    /// The total, ms.
    pub ms: f64,
    /// Queued prefill ahead of it (ours + the engine's others), ms.
    pub queue_ms: f64,
    /// Its own uncached prefill (+ the miss penalty), ms.
    pub own_ms: f64,
    /// One decode step, ms.
    pub decode_ms: f64,
    /// The prefill rate used, tokens/s.
    pub tps: f64,
    /// Where [`Self::tps`] comes from: the instance's own samples, or, before it has
    /// `min_samples` of them, the fleet's mean or the prior (the explanation says which).
    pub tps_from: RateFrom,
    /// The instance's prefill utilization: the share of recent routing decisions that found
    /// requests waiting for their first token there (0 until [`CostModel::utilization`]).
    pub rho: f64,
    /// Requests the gateway dispatched to the instance per second, lately (decayed over
    /// [`ARRIVAL_TAU_MS`]; 0 until [`CostModel::utilization`]): the rate at which its live
    /// sessions come back. The fleet's total is shared out by the requests in flight where
    /// that counts more (sessions placed a moment ago; see [`CostModel::arrivals`]).
    pub lambda: f64,
    /// The fleet's shared backlog: the mean queued prefill over the candidates, ms (0 until
    /// [`CostModel::arrivals`]). See [`Self::harm_ms`].
    pub pool_queue_ms: f64,
    /// The mean number of requests recent routing decisions found waiting for their first
    /// token there (decayed like [`Self::rho`]; 0 until [`CostModel::utilization`]). See
    /// [`Self::harm_ms`].
    pub waiting: f64,
    /// What the requests that will follow this one there pay for their own prefill, ms
    /// ([`CostModel::follow`]; 0 until learned). See [`Self::follow_ms`].
    pub follow_ms: f64,
}

impl Estimate {
    /// The delay this request's own prefill adds for the requests that arrive behind it
    /// while it runs: own × ρ / (1 − ρ) (ρ capped at [`RHO_CAP`]: an M/M/1 queue's mean
    /// number of requests present). Near 0 on an idle instance; on a saturated one the work
    /// a request adds delays everyone after it.
    pub fn queue_cost_ms(&self) -> f64 {
        let r = self.rho.clamp(0.0, RHO_CAP);
        self.own_ms * r / (1.0 - r)
    }
}

impl Estimate {
    /// What placing a prompt nobody holds here costs, ms: its own predicted TTFT
    /// ([`Self::ms`]), what its prefill costs the requests arriving behind it
    /// ([`Self::harm_ms`]) and what the requests that will share it prefill here
    /// ([`Self::follow_ms`]). The least-cached layer and `predicted-ttft` weigh a cold prompt
    /// by it.
    pub fn cold_cost_ms(&self) -> f64 {
        self.ms + self.harm_ms() + self.follow_ms
    }

    /// What this request's own prefill costs the requests that arrive at the instance while
    /// the work it adds is still ahead of them, summed over them (ms): each waits `own`
    /// longer (those arriving during its own prefill `own / 2` on average) until the
    /// instance's busy period would have ended, so
    ///
    /// ```text
    ///   λ · own · (B + own / 2) · (1 + min(N, ρ / (1 − ρ)))
    /// ```
    ///
    /// λ the instance's arrival rate ([`Self::lambda`]); `B` the backlog ahead of the work:
    /// its own queue, or the fleet's mean queue ([`Self::pool_queue_ms`]) when that is
    /// longer, because a router that sends new work to the shorter queues refills a short
    /// one to the fleet's level; the last factor how much longer a busy period lasts than its
    /// backlog ([`Self::busy_factor`]: `1 / (1 − ρ)` at the instance's utilization
    /// [`Self::rho`], capped at [`RHO_CAP`], unless the requests found waiting there, `N`,
    /// were fewer than an M/M/1 queue would hold). Quadratic in the prompt: a cold 12k-token
    /// prefill on an engine whose live sessions come back every second stalls several warm
    /// turns behind it, where a 1k prompt's costs them a few milliseconds. And on a
    /// saturated instance the work stays ahead of every later arrival: a hot tenant's home
    /// drains its cheap warm turns fast and looks nearly idle this instant, but each of them
    /// would wait behind a cold prompt placed there (`many-4k-agents-half-overload`, seed 1:
    /// one such placement cost the next ~25 hot turns 3–4 s each).
    pub fn harm_ms(&self) -> f64 {
        self.lambda.max(0.0) * self.own_ms / 1000.0
            * (self.queue_ms.max(self.pool_queue_ms) + self.own_ms / 2.0)
            * self.busy_factor()
    }

    /// How much longer the instance's busy period lasts than the backlog that starts it:
    /// `1 / (1 − ρ)` for an M/G/1 queue, which is `1 +` the mean number of requests an
    /// M/M/1 queue at that utilization holds (ρ / (1 − ρ)). Where decisions found fewer
    /// waiting than that ([`Self::waiting`]), `1 +` that number: sessions that wait for
    /// their answer before sending the next turn keep an instance busy at every decision
    /// (ρ → 1) with one or two requests waiting, and `1 / (1 − ρ)` priced it like the
    /// saturated queue next to it with sixteen.
    pub fn busy_factor(&self) -> f64 {
        let rho = self.rho.clamp(0.0, RHO_CAP);
        1.0 + self.waiting.max(0.0).min(rho / (1.0 - rho))
    }
}

/// The most harm ([`Estimate::harm_ms`]) a cold prompt's placement may do: the least harm
/// among the eligible candidates plus `slack_ms`. Within the room of its total cost a cold
/// prompt still does not go where its prefill stalls more returning sessions than it must:
/// a hot tenant's home drains its cheap warm turns fast, so its TTFT plus harm can be the
/// least while its harm is the largest. The layered mode's least-cached layer and policy
/// mode's `predicted-ttft` filter both cut there (the filter did not until matrix run 22,
/// `many-12k-people-half-high-8eq` seed 9: policy mode placed a new tenant's cold 14k prompt
/// next to the hottest tenant, harm 1.5 s against the least 0.36 s, where the layered
/// default did not).
pub fn harm_cap(est: &[Estimate], eligible: impl Fn(usize) -> bool, slack_ms: f64) -> f64 {
    let least = est
        .iter()
        .enumerate()
        .filter(|(i, _)| eligible(*i))
        .map(|(_, e)| e.harm_ms())
        .fold(f64::INFINITY, f64::min);
    least + slack_ms.max(0.0)
}

/// Time constant of an instance's arrival rate ([`Estimate::lambda`], ms): about the time a
/// session takes to come back for its next turn, long enough to count the live sessions
/// there, short enough to follow sessions that ended.
pub const ARRIVAL_TAU_MS: f64 = 10_000.0;

/// The highest utilization [`Estimate::queue_cost_ms`] counts (a saturated instance: × 19).
pub const RHO_CAP: f64 = 0.95;
/// Weight of one routing decision in an instance's utilization average (about the last
/// 32 decisions of the service).
const RHO_ALPHA: f64 = 1.0 / 32.0;

impl Estimate {
    /// `est=412ms(q=300+own=100+dec=12 @9.5k/s)`
    /// (`… busy=0.88 avg_wait=1.2 arrivals=2.1/s harm=96ms follow=40ms)` when the utilization
    /// was sampled: [`Self::rho`], [`Self::waiting`], [`Self::lambda`], [`Self::harm_ms`] (what
    /// the least-cached layer and `predicted-ttft` add for a cold prompt), [`Self::follow_ms`].)
    pub fn describe(&self, out: &mut String) {
        let _ = write!(
            out,
            "est={:.0}ms(q={:.0}+own={:.0}+dec={:.0} @{:.1}k/s{}",
            self.ms,
            self.queue_ms,
            self.own_ms,
            self.decode_ms,
            self.tps / 1000.0,
            self.tps_from.suffix()
        );
        if self.rho > 0.0 {
            let _ = write!(out, " busy={:.2}", self.rho);
        }
        if self.waiting > 0.0 {
            let _ = write!(out, " avg_wait={:.1}", self.waiting);
        }
        if self.lambda > 0.0 {
            let _ = write!(out, " arrivals={:.1}/s", self.lambda);
        }
        let harm = self.harm_ms();
        if harm > 0.0 {
            let _ = write!(out, " harm={harm:.0}ms");
        }
        if self.follow_ms > 0.0 {
            let _ = write!(out, " follow={:.0}ms", self.follow_ms);
        }
        out.push(')');
    }
}

/// The learned per-instance rates. See the module documentation.
#[derive(Debug, Default)]
pub struct CostModel {
    cfg: RwLock<CostConfig>,
    learned: RwLock<HashMap<InstanceKey, Learned>>,
    /// Mean uncached tokens per request (EWMA over every observation), ×1000 fixed point:
    /// the size of a request queued in an engine by someone else.
    mean_uncached_milli: AtomicU64,
    /// Per instance: the share of recent decisions that found it with requests waiting for
    /// their first token, and the mean number they found waiting ([`Self::utilization`]).
    busy: parking_lot::Mutex<HashMap<InstanceKey, (f64, f64)>>,
    /// Per instance: its decayed dispatch count and when it was last updated (ms)
    /// ([`Self::dispatched`]).
    arrivals: parking_lot::Mutex<HashMap<InstanceKey, (f64, u64)>>,
    /// The fleet's followers ([`Self::routed`]): the share of recent decisions whose instance
    /// held at least half the prompt, and their mean uncached tokens.
    follow: parking_lot::Mutex<Follow>,
}

/// What [`CostModel::routed`] learned: see [`CostModel::follow`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Follow {
    /// The share of recent routing decisions that sent a request where at least half of its
    /// prompt was cached (an EWMA over about [`FOLLOW_WINDOW`] decisions).
    pub warm_share: f64,
    /// Their mean uncached tokens (the new turn of a session, a new user message under a
    /// tenant's system prompt).
    pub warm_uncached: f64,
    pub decisions: u64,
}

/// Decisions the follower share averages over (a running mean until then).
pub const FOLLOW_WINDOW: f64 = 128.0;
/// Decisions before the follower share counts.
pub const FOLLOW_MIN_DECISIONS: u64 = 16;
/// The highest follower share counted: at most 19 followers per placement.
const FOLLOW_SHARE_CAP: f64 = 0.95;

impl Follow {
    /// Requests that follow a placement of a prompt nobody held, on average: the requests
    /// routed to a cache holding their prompt per request routed to none, `w / (1 − w)`
    /// (`w` the warm share, capped at 0.95). 0 before [`FOLLOW_MIN_DECISIONS`].
    pub fn followers(&self) -> f64 {
        if self.decisions < FOLLOW_MIN_DECISIONS {
            return 0.0;
        }
        let w = self.warm_share.clamp(0.0, FOLLOW_SHARE_CAP);
        w / (1.0 - w)
    }
}

impl CostModel {
    pub fn new(cfg: CostConfig) -> Self {
        CostModel {
            cfg: RwLock::new(cfg),
            ..CostModel::default()
        }
    }

    pub fn config(&self) -> CostConfig {
        self.cfg.read().clone()
    }

    /// New settings (a config reload); what was learned stays.
    pub fn set_config(&self, cfg: CostConfig) {
        *self.cfg.write() = cfg;
    }

    /// What `key` taught the model so far.
    pub fn learned(&self, key: InstanceKey) -> Learned {
        self.learned.read().get(&key).copied().unwrap_or_default()
    }

    /// `key`'s prefill rate, tokens/s: its own once it has `min_samples`, else the mean of
    /// the instances that have them, else the prior (the rule of [`Self::estimate_all`], with
    /// every instance the model knows as the fleet).
    pub fn prefill_tps(&self, key: InstanceKey) -> f64 {
        let cfg = self.cfg.read();
        let map = self.learned.read();
        let fleet = cfg.fleet_rate(map.values());
        cfg.rate(map.get(&key), fleet).0
    }

    /// Learns from one routing decision: its request of `prompt_tokens` went where
    /// `cached_tokens` of it are held. See [`Self::follow`].
    pub fn routed(&self, prompt_tokens: u64, cached_tokens: u64) {
        if prompt_tokens == 0 {
            return;
        }
        let warm = warm(prompt_tokens, cached_tokens);
        let mut f = self.follow.lock();
        // The running mean at first, then an EWMA over the window.
        let a = (1.0 / (f.decisions as f64 + 1.0)).max(1.0 / FOLLOW_WINDOW);
        f.warm_share += a * (f64::from(u8::from(warm)) - f.warm_share);
        if warm {
            let u = prompt_tokens.saturating_sub(cached_tokens) as f64;
            f.warm_uncached = if f.warm_uncached == 0.0 {
                u
            } else {
                // Only warm decisions move it, so it averages at 4 × the share's rate.
                f.warm_uncached + (4.0 * a).min(1.0) * (u - f.warm_uncached)
            };
        }
        f.decisions = f.decisions.saturating_add(1);
    }

    /// The fleet's followers: where a prompt nobody holds is placed, the requests that share
    /// it come after it (a session's next turns, the tenant's next sessions) for as long as
    /// the cache keeps it, each prefilling its own new part at that instance's rate. On a
    /// fleet of equal engines that is the same everywhere; on mixed GPU generations a
    /// placement on a half-speed engine doubles every follower's prefill.
    /// [`Estimate::follow_ms`] = [`Follow::followers`] × their mean uncached tokens ÷ the
    /// instance's rate.
    pub fn follow(&self) -> Follow {
        *self.follow.lock()
    }

    /// Forgets an instance (it left).
    pub fn forget(&self, key: InstanceKey) {
        self.learned.write().remove(&key);
        self.busy.lock().remove(&key);
        self.arrivals.lock().remove(&key);
    }

    /// Learns from a completed request on `key`.
    pub fn observe(&self, key: InstanceKey, o: &Observation) {
        let cfg = self.cfg.read().clone();
        let a = cfg.alpha.clamp(0.01, 1.0);
        let mut map = self.learned.write();
        let l = map.entry(key).or_default();
        if let Some(t) = o.tpot_ms.filter(|t| t.is_finite() && *t > 0.0) {
            l.step_ms = if l.step_samples == 0 {
                t
            } else {
                l.step_ms + a * (t - l.step_ms)
            };
            l.step_samples = l.step_samples.saturating_add(1);
        }
        // Prefill rate: only from requests with real prefill work (a cache hit's TTFT is one
        // decode step, which says nothing about the prefill rate), and none queued ahead of
        // them. The work queued ahead is counted whole at dispatch, however far the engine
        // had got with it: a request sent 5 s into someone's 6-s prefill saw all of it
        // queued and waited 1 s, and taught a rate several times too high (learned 6.0k/s
        // where the engine does 2.3k/s, in `many-12k-people-half-high-8eq`), which then drew
        // every cold prompt there.
        let work = if o.queued_tokens == 0 {
            o.uncached_tokens as f64
        } else {
            0.0
        };
        let step = if l.step_samples > 0 {
            l.step_ms
        } else {
            cfg.prior_step_ms
        };
        let prefill_ms = (o.ttft_ms - step).max(o.ttft_ms * 0.5);
        if work >= 64.0 && prefill_ms.is_finite() && prefill_ms > 0.0 {
            let lo = cfg.prior_prefill_tps / 1000.0;
            let hi = cfg.prior_prefill_tps * 1000.0;
            let tps = (work * 1000.0 / prefill_ms).clamp(lo, hi);
            l.prefill_tps = if l.prefill_samples == 0 {
                tps
            } else {
                l.prefill_tps + a * (tps - l.prefill_tps)
            };
            l.prefill_samples = l.prefill_samples.saturating_add(1);
        }
        drop(map);
        let prev = self.mean_uncached_milli.load(Relaxed) as f64 / 1000.0;
        let next = if prev == 0.0 {
            o.uncached_tokens as f64
        } else {
            prev + a * (o.uncached_tokens as f64 - prev)
        };
        self.mean_uncached_milli
            .store((next * 1000.0) as u64, Relaxed);
    }

    /// Estimates every candidate for `req` into `out` (one slot per candidate).
    pub fn estimate_all(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [Estimate]) {
        let cfg = self.cfg.read();
        let map = self.learned.read();
        // The fleet's rate for instances without enough samples of their own.
        let fleet = cfg.fleet_rate(cands.iter().filter_map(|c| map.get(&c.key)));
        // The size of a request someone else queued: the mean this model saw, else this one's.
        let mean_uncached = match self.mean_uncached_milli.load(Relaxed) as f64 / 1000.0 {
            m if m > 0.0 => m,
            _ => req.prompt_tokens as f64,
        };
        let follow = self.follow();
        let follow_tokens = follow.followers() * follow.warm_uncached;
        for (e, c) in out.iter_mut().zip(cands) {
            let known = map.get(&c.key);
            let l = known.copied().unwrap_or_default();
            let (tps, tps_from) = cfg.rate(known, fleet);
            let step = if l.step_samples > 0 {
                l.step_ms
            } else {
                cfg.prior_step_ms
            };
            let others = c
                .engine
                .map_or(0.0, |el| f64::from(el.waiting).max(0.0) - c.waiting as f64);
            let queued = c.prefill_tokens as f64 + others.max(0.0) * mean_uncached;
            let own = req.uncached_tokens(c) as f64;
            let queue_ms = queued * 1000.0 / tps;
            let own_ms = own * (1.0 + cfg.miss_penalty.max(0.0)) * 1000.0 / tps;
            *e = Estimate {
                ms: queue_ms + own_ms + step,
                queue_ms,
                own_ms,
                decode_ms: step,
                tps,
                tps_from,
                rho: 0.0,
                lambda: 0.0,
                pool_queue_ms: 0.0,
                waiting: 0.0,
                follow_ms: follow_tokens * 1000.0 / tps,
            };
        }
    }

    /// Samples each candidate's prefill busy state (requests waiting for their first token,
    /// ours or, with engine metrics, anyone's) into its utilization average and its mean
    /// count waiting, and writes them to `out[i].rho` and `out[i].waiting`. Call once per
    /// routing decision, after [`Self::estimate_all`]: arrivals see time averages, so the
    /// share of decisions that find an instance busy estimates its prefill utilization, and
    /// the mean count they find the mean number waiting.
    /// Also writes each one's arrival rate at `now_ms` ([`Self::arrivals`]).
    pub fn utilization(&self, cands: &[Candidate], now_ms: u64, out: &mut [Estimate]) {
        {
            let mut busy = self.busy.lock();
            for c in cands {
                let w = c
                    .waiting
                    .max(c.engine.map_or(0, |el| u64::from(el.waiting)))
                    as f64;
                let x = if w > 0.0 { 1.0 } else { 0.0 };
                let (r, n) = busy.entry(c.key).or_insert((0.0, 0.0));
                *r += RHO_ALPHA * (x - *r);
                *n += RHO_ALPHA * (w - *n);
            }
        }
        self.arrivals(cands, now_ms, out);
    }

    /// Counts a request dispatched to `key` at `now_ms` into its arrival rate
    /// ([`Estimate::lambda`]).
    pub fn dispatched(&self, key: InstanceKey, now_ms: u64) {
        let mut a = self.arrivals.lock();
        let (n, at) = a.entry(key).or_insert((0.0, now_ms));
        *n = decay(*n, *at, now_ms) + 1.0;
        *at = now_ms.max(*at);
    }

    /// Writes each candidate's arrival rate at `now_ms` (requests per second, from
    /// [`Self::dispatched`]) to `out[i].lambda`, its utilization and mean count waiting as
    /// last sampled to `out[i].rho` and `out[i].waiting`, and the fleet's mean queue over
    /// `cands` to `out[i].pool_queue_ms` ([`Estimate::harm_ms`]). Call after
    /// [`CostModel::estimate_all`]. The rates' total is the decayed count's; each instance
    /// gets at least its requests in flight times the fleet's turnover (total ÷ requests in
    /// flight), the others proportionally less ([`share_by_inflight`]).
    pub fn arrivals(&self, cands: &[Candidate], now_ms: u64, out: &mut [Estimate]) {
        let n = out.len().min(cands.len()).max(1) as f64;
        let pool_queue_ms = out.iter().map(|e| e.queue_ms).sum::<f64>() / n;
        let busy = self.busy.lock();
        let a = self.arrivals.lock();
        for (e, c) in out.iter_mut().zip(cands) {
            (e.rho, e.waiting) = busy.get(&c.key).copied().unwrap_or((0.0, 0.0));
            e.pool_queue_ms = pool_queue_ms;
            e.lambda = a.get(&c.key).map_or(0.0, |(n, at)| {
                decay(*n, *at, now_ms) * 1000.0 / ARRIVAL_TAU_MS
            });
        }
        drop((busy, a));
        share_by_inflight(cands, out);
    }

    /// Every instance's learned figures (for `/admin`).
    pub fn snapshot(&self) -> Vec<(InstanceKey, Learned)> {
        let mut v: Vec<_> = self.learned.read().iter().map(|(k, l)| (*k, *l)).collect();
        v.sort_by_key(|(k, _)| k.0);
        v
    }
}

/// Shares the candidates' total arrival rate ([`Estimate::lambda`]) out by where their
/// sessions are now. The decayed count learns a placement slowly: sessions placed a moment
/// ago count 0.1/s each although they come back as soon as they are answered (matrix run
/// 15's debug seed, `few-12k-agents-half-high` seed 6: a new tenant's first turns on e4
/// counted 0.1/s, a cold 14k prompt was placed behind them as the least harm, and their next
/// turns waited 2.3 s; with this share e4 counts 0.4/s, its neighbour 0.8/s).
/// A request in flight is a session that will come back, and the fleet turns its requests
/// in flight over at `Σλ / Σ in flight` per second (Little's law), so each instance counts
/// at least its own in flight at that rate; the rates are then scaled back to the decayed
/// total, which the fleet-wide count measures well: only where the rate is moves, not how
/// much there is (matrix run 17; unscaled, the nine-seed bar held in 9 cells, not 11).
fn share_by_inflight(cands: &[Candidate], out: &mut [Estimate]) {
    let (mut inflight, mut total) = (0u64, 0.0);
    for (e, c) in out.iter().zip(cands) {
        inflight += c.inflight_requests;
        total += e.lambda;
    }
    if inflight == 0 || total <= 0.0 {
        return;
    }
    let per = total / inflight as f64;
    let mut raised = 0.0;
    for (e, c) in out.iter_mut().zip(cands) {
        e.lambda = e.lambda.max(c.inflight_requests as f64 * per);
        raised += e.lambda;
    }
    for e in out.iter_mut() {
        e.lambda *= total / raised;
    }
}

/// `n` counted at `at`, decayed to `now` over [`ARRIVAL_TAU_MS`].
fn decay(n: f64, at: u64, now: u64) -> f64 {
    n * (-(now.saturating_sub(at) as f64) / ARRIVAL_TAU_MS).exp()
}

#[cfg(test)]
mod tests;
