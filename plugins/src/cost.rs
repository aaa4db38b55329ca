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
    /// The instance's prefill utilization: the share of recent routing decisions that found
    /// requests waiting for their first token there (0 until [`CostModel::utilization`]).
    pub rho: f64,
    /// Requests the gateway dispatched to the instance per second, lately (decayed over
    /// [`ARRIVAL_TAU_MS`]; 0 until [`CostModel::utilization`]): the rate at which its live
    /// sessions come back.
    pub lambda: f64,
    /// The fleet's shared backlog: the mean queued prefill over the candidates, ms (0 until
    /// [`CostModel::arrivals`]). See [`Self::harm_ms`].
    pub pool_queue_ms: f64,
    /// The mean number of requests recent routing decisions found waiting for their first
    /// token there (decayed like [`Self::rho`]; 0 until [`CostModel::utilization`]). See
    /// [`Self::harm_ms`].
    pub waiting: f64,
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
    /// (`… busy=0.88 avg_wait=1.2 arrivals=2.1/s)` when the utilization was sampled:
    /// [`Self::rho`], [`Self::waiting`], [`Self::lambda`].)
    pub fn describe(&self, out: &mut String) {
        let _ = write!(
            out,
            "est={:.0}ms(q={:.0}+own={:.0}+dec={:.0} @{:.1}k/s",
            self.ms,
            self.queue_ms,
            self.own_ms,
            self.decode_ms,
            self.tps / 1000.0
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
    /// the instances that have them, else the prior.
    pub fn prefill_tps(&self, key: InstanceKey) -> f64 {
        let cfg = self.cfg.read();
        let map = self.learned.read();
        let learned = |l: &Learned| l.prefill_samples >= cfg.min_samples;
        if let Some(l) = map.get(&key).filter(|l| learned(l)) {
            return l.prefill_tps.max(1.0);
        }
        let (sum, n) = map
            .values()
            .filter(|l| learned(l))
            .fold((0.0, 0u32), |(s, n), l| (s + l.prefill_tps, n + 1));
        if n > 0 {
            (sum / f64::from(n)).max(1.0)
        } else {
            cfg.prior_prefill_tps.max(1.0)
        }
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
        let (mut sum, mut n) = (0.0, 0u32);
        for c in cands {
            if let Some(l) = map
                .get(&c.key)
                .filter(|l| l.prefill_samples >= cfg.min_samples)
            {
                sum += l.prefill_tps;
                n += 1;
            }
        }
        let fleet_tps = if n > 0 {
            sum / f64::from(n)
        } else {
            cfg.prior_prefill_tps
        };
        // The size of a request someone else queued: the mean this model saw, else this one's.
        let mean_uncached = match self.mean_uncached_milli.load(Relaxed) as f64 / 1000.0 {
            m if m > 0.0 => m,
            _ => req.prompt_tokens as f64,
        };
        for (e, c) in out.iter_mut().zip(cands) {
            let l = map.get(&c.key).copied().unwrap_or_default();
            let tps = if l.prefill_samples >= cfg.min_samples {
                l.prefill_tps
            } else {
                fleet_tps
            }
            .max(1.0);
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
                rho: 0.0,
                lambda: 0.0,
                pool_queue_ms: 0.0,
                waiting: 0.0,
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
    /// [`CostModel::estimate_all`].
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
    }

    /// Every instance's learned figures (for `/admin`).
    pub fn snapshot(&self) -> Vec<(InstanceKey, Learned)> {
        let mut v: Vec<_> = self.learned.read().iter().map(|(k, l)| (*k, *l)).collect();
        v.sort_by_key(|(k, _)| k.0);
        v
    }
}

/// `n` counted at `at`, decayed to `now` over [`ARRIVAL_TAU_MS`].
fn decay(n: f64, at: u64, now: u64) -> f64 {
    n * (-(now.saturating_sub(at) as f64) / ARRIVAL_TAU_MS).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(i: u64, queued: u64) -> Candidate {
        Candidate {
            idx: i as usize,
            key: InstanceKey(i),
            prefill_tokens: queued,
            ..Default::default()
        }
    }

    /// A model with these priors (tokens/s, ms per decode step).
    fn model(prior_prefill_tps: f64, prior_step_ms: f64) -> CostModel {
        CostModel::new(CostConfig {
            prior_prefill_tps,
            prior_step_ms,
            ..CostConfig::default()
        })
    }

    fn est(m: &CostModel, req: &RequestView<'_>, cs: &[Candidate]) -> Vec<Estimate> {
        let mut out = vec![Estimate::default(); cs.len()];
        m.estimate_all(req, cs, &mut out);
        out
    }

    fn req(prompt_tokens: u64) -> RequestView<'static> {
        RequestView {
            prompt_tokens,
            block_tokens: 16,
            ..Default::default()
        }
    }

    #[test]
    fn known_queues_and_matches_give_the_expected_order() {
        let m = model(1000.0, 10.0);
        let index = crate::prefix::PrefixIndex::default();
        let blocks: Vec<u64> = (0..64).collect(); // 64 blocks of 16 = 1024 tokens
        index.insert(&blocks, InstanceKey(0), 0); // 0 holds the whole prompt …
        let cs = [cand(0, 3000), cand(1, 0), cand(2, 500)]; // … but has 3 s queued
        let pm = index.match_prefix(&blocks, 0);
        let r = RequestView {
            prefix: Some(&pm),
            blocks: &blocks,
            ..req(1024)
        };
        let e = est(&m, &r, &cs);
        // 0: 3000/1000 s + 0 + 10 ms; 1: 1024 ms + 10; 2: 500 + 1024 + 10.
        assert_eq!(e[0].ms, 3010.0);
        assert_eq!(e[1].ms, 1034.0);
        assert_eq!(e[2].ms, 1534.0);
        // With a short queue the holder wins.
        let cs = [cand(0, 200), cand(1, 0), cand(2, 0)];
        let e = est(&m, &r, &cs);
        assert!(e[0].ms < e[1].ms && e[1].ms == e[2].ms, "{e:?}");
        // A miss penalty makes the holder's lead larger.
        m.set_config(CostConfig {
            miss_penalty: 1.0,
            ..m.config()
        });
        let e2 = est(&m, &r, &cs);
        assert_eq!(e2[0].ms, e[0].ms);
        assert_eq!(e2[1].ms, 10.0 + 2048.0);
    }

    #[test]
    fn rates_are_learned_per_instance_and_new_instances_get_the_fleets() {
        let m = model(8000.0, 10.0);
        // Instance 1 prefills 1000 tok/s: 1000 own tokens took 1 s + one 10 ms step.
        for _ in 0..5 {
            m.observe(
                InstanceKey(1),
                &Observation {
                    queued_tokens: 0,
                    uncached_tokens: 1000,
                    ttft_ms: 1010.0,
                    tpot_ms: Some(10.0),
                },
            );
        }
        let l = m.learned(InstanceKey(1));
        assert!((l.prefill_tps - 1000.0).abs() < 1.0, "{l:?}");
        assert_eq!(l.step_ms, 10.0);
        // A cache hit (little work) teaches nothing about the prefill rate.
        m.observe(
            InstanceKey(1),
            &Observation {
                queued_tokens: 0,
                uncached_tokens: 16,
                ttft_ms: 12.0,
                tpot_ms: None,
            },
        );
        assert_eq!(m.learned(InstanceKey(1)).prefill_samples, 5);
        // Nor does a request with work queued ahead of it: how much of that work the engine
        // had done when it was sent is unknown (sent near the end of a 12k prefill, it waited
        // a moment and would teach 13 times the rate).
        m.observe(
            InstanceKey(1),
            &Observation {
                queued_tokens: 12_000,
                uncached_tokens: 1000,
                ttft_ms: 1010.0,
                tpot_ms: None,
            },
        );
        let l = m.learned(InstanceKey(1));
        assert_eq!(l.prefill_samples, 5);
        assert!((l.prefill_tps - 1000.0).abs() < 1.0, "{l:?}");
        // Instance 2 has no history: it gets the fleet's learned 1000 tok/s, not the
        // optimistic prior (and not a pessimistic one that would starve it).
        let e = est(&m, &req(1000), &[cand(1, 0), cand(2, 0)]);
        assert!((e[0].ms - e[1].ms).abs() < 1.0, "{e:?}");
        assert!((e[1].tps - 1000.0).abs() < 1.0);
    }

    #[test]
    fn an_idle_restarted_instance_gets_traffic() {
        let m = CostModel::new(CostConfig::default());
        for k in 0..3 {
            for _ in 0..3 {
                m.observe(
                    InstanceKey(k),
                    &Observation {
                        queued_tokens: 0,
                        uncached_tokens: 8000,
                        ttft_ms: 1000.0,
                        tpot_ms: Some(20.0),
                    },
                );
            }
        }
        // Instance 3 restarted: empty cache, no history. Everyone else holds the prompt but
        // has a queue; the idle one is cheapest.
        let blocks: Vec<u64> = (0..32).collect();
        let index = crate::prefix::PrefixIndex::default();
        for k in 0..3 {
            index.insert(&blocks, InstanceKey(k), 0);
        }
        let pm = index.match_prefix(&blocks, 0);
        let r = RequestView {
            prefix: Some(&pm),
            blocks: &blocks,
            ..req(512)
        };
        let cs = [cand(0, 6000), cand(1, 7000), cand(2, 9000), cand(3, 0)];
        let e = est(&m, &r, &cs);
        let best = (0..4).min_by(|&a, &b| e[a].ms.total_cmp(&e[b].ms)).unwrap();
        assert_eq!(best, 3, "{e:?}");
    }

    #[test]
    fn arrivals_decay_and_a_prefills_harm_is_quadratic_in_its_length() {
        let m = model(1000.0, 0.0);
        let (busy, quiet) = (cand(1, 0), cand(2, 0));
        for _ in 0..10 {
            m.dispatched(busy.key, 50_000);
        }
        let harm = |tokens: u64, now: u64| {
            let mut e = est(&m, &req(tokens), &[busy, quiet]);
            m.arrivals(&[busy, quiet], now, &mut e);
            (e[0].lambda, e[0].harm_ms(), e[1].harm_ms())
        };
        // 10 requests within the 10-s time constant: 1 per second.
        let (lambda, h1, q1) = harm(1000, 50_000);
        assert!((lambda - 1.0).abs() < 1e-9, "{lambda}");
        // 1,000 tokens prefill 1 s: those arriving meanwhile (1) wait 0.5 s on average.
        assert!((h1 - 500.0).abs() < 1e-6, "{h1}");
        assert_eq!(q1, 0.0);
        // Twice the prompt, four times the harm.
        let (_, h2, _) = harm(2000, 50_000);
        assert!((h2 - 4.0 * h1).abs() < 1e-6, "{h2}");
        // A time constant later, a third of the rate is left.
        let (lambda, _, _) = harm(1000, 60_000);
        assert!((lambda - (-1.0f64).exp()).abs() < 1e-9, "{lambda}");
        // Work queued ahead: those arriving during it wait the whole prefill more.
        let mut q = busy;
        q.prefill_tokens = 1000;
        let mut e = est(&m, &req(1000), &[q]);
        m.arrivals(&[q], 50_000, &mut e);
        assert!((e[0].harm_ms() - 1500.0).abs() < 1e-6, "{:?}", e[0]);
    }

    /// Two instances the gateway sent requests to in the 10 s before 50 s, `fast` every
    /// 500 ms and `slow` every second, then 200 decisions at 50 s that find them as they are
    /// (their `waiting`, their queue): the estimates of a `prompt`-token cold request.
    fn sampled_pair(m: &CostModel, fast: Candidate, slow: Candidate, prompt: u64) -> Vec<Estimate> {
        for t in 0..20 {
            m.dispatched(fast.key, 40_000 + t * 500);
            if t % 2 == 0 {
                m.dispatched(slow.key, 40_000 + t * 500);
            }
        }
        let mut e = est(m, &req(prompt), &[fast, slow]);
        for _ in 0..200 {
            m.utilization(&[fast, slow], 50_000, &mut e);
        }
        e
    }

    #[test]
    fn in_a_saturated_fleet_a_cold_prefill_harms_most_where_sessions_come_back_most() {
        let m = model(1000.0, 0.0);
        // A hot tenant's home drains its cheap warm turns fast (200 ms queued) while its
        // sessions come back 2 times a second; the other engine has 2 s queued and 1 arrival
        // a second. Both have requests waiting at every decision (the fleet is saturated):
        // 3 cheap ones on the hot home, 2 on the other.
        let (mut hot, mut cold) = (cand(1, 200), cand(2, 2000));
        hot.waiting = 3;
        cold.waiting = 2;
        let e = sampled_pair(&m, hot, cold, 1000);
        assert!(e[0].rho > 0.9 && e[1].rho > 0.9, "{e:?}");
        assert!((e[0].waiting - 3.0).abs() < 1e-2, "{e:?}");
        assert!((e[0].busy_factor() - 4.0).abs() < 1e-2, "{e:?}");
        assert!((e[0].pool_queue_ms - 1100.0).abs() < 1e-6, "{e:?}");
        // Its own wait is shorter on the hot home ...
        assert!(e[0].ms < e[1].ms, "{e:?}");
        // ... but the work it adds there stalls twice as many requests for as long as the
        // fleet stays busy (its queue is refilled to the fleet's), more than the shorter
        // queue saves.
        let (h0, h1) = (e[0].harm_ms(), e[1].harm_ms());
        assert!(h0 > h1, "{h0} vs {h1}");
        assert!(e[0].ms + h0 > e[1].ms + h1, "{e:?}");
        // An idle fleet: no persistence, and the hot home's own short queue is all it counts.
        let m2 = model(1000.0, 0.0);
        let idle = cand(1, 0);
        m2.dispatched(idle.key, 50_000);
        let mut e = est(&m2, &req(1000), &[idle]);
        m2.utilization(&[idle], 50_000, &mut e);
        assert!(e[0].rho < 0.05, "{e:?}");
        assert!((e[0].harm_ms() - 0.1 * 500.0).abs() < 1e-6);
    }

    #[test]
    fn a_busy_instance_with_few_waiting_is_not_priced_like_a_saturated_queue() {
        // The overload cell (`many-4k-agents-half-overload`, seed 4): sessions that wait for
        // their answers keep both engines busy at every decision. e2 drains its sessions'
        // warm turns with 1 request waiting (1.3 s queued, 2.1 arrivals/s); e4 has 16 waiting
        // (23 s queued) and half the arrivals, because its sessions are stuck in that queue.
        let m = model(1000.0, 0.0);
        let (mut e2, mut e4) = (cand(2, 1300), cand(4, 23_000));
        e2.waiting = 1;
        e4.waiting = 16;
        let e = sampled_pair(&m, e2, e4, 4800);
        assert!(e[0].rho > 0.9 && e[1].rho > 0.9, "{e:?}");
        assert!(e[0].lambda > 1.5 * e[1].lambda, "{e:?}");
        // The busy period outlasts the backlog by the requests found there: × (1 + 1) on e2
        // and × (1 + 16) on e4, where 1 / (1 − ρ) would be × 20 on both (ρ at its cap).
        assert!((e[0].busy_factor() - 2.0).abs() < 1e-2, "{e:?}");
        assert!(e[1].busy_factor() > 15.0, "{e:?}");
        // A cold 4.8k prompt harms e4's stuck sessions more than e2's, and goes to e2: with
        // 1 / (1 − ρ) on both, e2's higher arrival rate and the fleet's mean queue made e4
        // the cheaper, and its queue grew to 27 s while e2 stayed near 1 s.
        let (h2, h4) = (e[0].harm_ms(), e[1].harm_ms());
        assert!(e[0].ms + h2 < e[1].ms + h4, "{h2} vs {h4}: {e:?}");
        let old = |x: &Estimate| x.harm_ms() / x.busy_factor() / (1.0 - x.rho.min(RHO_CAP));
        assert!(e[0].ms + old(&e[0]) > e[1].ms + old(&e[1]), "{e:?}");
    }

    #[test]
    fn requests_the_engine_queued_for_others_count() {
        let m = model(1000.0, 0.0);
        m.observe(
            InstanceKey(9),
            &Observation {
                queued_tokens: 0,
                uncached_tokens: 500,
                ttft_ms: 500.0,
                tpot_ms: None,
            },
        );
        let mut busy = cand(0, 0);
        busy.engine = Some(crate::candidate::EngineLoad {
            running: 8,
            waiting: 4,
            kv_usage: 0.9,
        });
        let e = est(&m, &req(100), &[busy, cand(1, 0)]);
        // 4 requests of ~500 uncached tokens queued by another gateway: +2 s.
        assert!((e[0].queue_ms - 2000.0).abs() < 1.0, "{e:?}");
        assert_eq!(e[1].queue_ms, 0.0);
    }
}
