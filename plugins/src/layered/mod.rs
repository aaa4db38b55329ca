//! Layered mode: stages in order, the first that routes wins ([`FirstHit`]). The built-in
//! stages are session affinity → prefix cache, and load balancing always comes last; plain
//! load balancing is a [`FirstHit`] with no stage before the balancer.
//!
//! 1. **Session affinity** ([`AffinityStage`]): the [`SessionTable`](crate::session::SessionTable) maps the session key
//!    to an instance.
//!    * `strict`: always the bound instance. If it is not among the candidates (gone,
//!      unhealthy, already tried), the lower layers choose and the session rebinds
//!      (`affinity-rebind`).
//!    * `soft`: the bound instance unless its [`Escape`] rule says leave — by default the
//!      stay-or-move comparison ([`Adaptive`]) with the TTFT tolerance as a floor; or its
//!      predicted TTFT beyond a tolerance of the best; or its load > average ×
//!      `soft_max_load_ratio` ("load" is the balancing figure, [`LbPolicy::load_of`]); then
//!      the lower layers choose and the session rebinds (`affinity-escape`).
//!    * The table's `ttl` and `max_entries` are the table's own ([`SessionTable`](crate::session::SessionTable)).
//! 2. **Prefix cache** ([`PrefixStage`]): reads the prompt's match against the prefix index
//!    ([`RequestView::prefix`]); hit ratio = matched blocks / prompt blocks, per candidate. A
//!    candidate is eligible by its [`Eligibility`]: the gateway's default compares the cost
//!    of waiting for it with recomputing elsewhere plus the copy's placement ([`Adaptive`]);
//!    the fixed rule wants load ≤ average × (1 + `load_tolerance`, default 0.3) and waiting ≤
//!    `waiting_threshold` (default 2). The eligible candidate with the longest
//!    match wins (ties: lower load, then a rotation by `turn`) if its ratio ≥ `min_hit_ratio`
//!    (default 0.50); otherwise it is a miss. Reason `prefix(0.83)`, or `prefix-spill` when
//!    the adaptive rule moved a cached prompt away and a lower layer chose.
//! 3. **Least cached** (optional, [`LeastCachedStage`]): among the candidates with a near-best
//!    predicted TTFT, the one the prefix index believes holds the fewest blocks. Reason
//!    `least-cached`. With `cluster: {placement: rendezvous}` a [`RendezvousStage`] comes
//!    first: the session's (or the first block's) weighted rendezvous hash over the engines'
//!    scraped load, the same on every replica (`rendezvous(session)`, `rendezvous(prefix)`).
//! 4. **Load balancing**: [`balance::pick`] with the picker's policy. Always routes.
//!
//! A stage is read-only while deciding; the gateway reports the dispatch
//! ([`Picker::on_dispatch`]: affinity binds the session) and the completion
//! ([`Picker::on_complete`]: affinity refreshes the binding). The prefix index itself is the
//! gateway's model of the engines' caches: it inserts every dispatched prompt, whatever the
//! scheduler.

use std::borrow::Cow;
use std::sync::Arc;

use rand::{Rng, RngCore};

use crate::balance::{self, LbPolicy};
use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::{CostModel, Estimate};
use crate::decision::{AffinityOutcome, Decision, Layer, LayeredRow, LayeredTrace, Trace};
use crate::pipeline::{Completion, Picker};

mod adaptive;
mod affinity;
mod ctx;
mod least_cached;
mod prefix;
mod rendezvous;

/// No layer placed the request: the load balancing policy chooses (predicted TTFT: the lowest
/// estimate, exact ties at random).
fn balance_hit(
    policy: LbPolicy,
    req: &RequestView<'_>,
    cands: &[Candidate],
    est: &[Estimate],
    min_est: f64,
    rng: &mut dyn RngCore,
) -> Option<Hit> {
    if policy == LbPolicy::PredictedTtft {
        let tol = 1e-9 * min_est.abs().max(1e-9);
        let tied = est.iter().filter(|e| e.ms - min_est <= tol).count();
        let k = if tied > 1 { rng.gen_range(0..tied) } else { 0 };
        let pos = (0..est.len())
            .filter(|&i| est[i].ms - min_est <= tol)
            .nth(k)?;
        return Some(Hit {
            pos,
            layer: Layer::Balance,
            reason: Cow::Borrowed(policy.as_str()),
        });
    }
    let p = balance::pick(policy, cands, req.turn)?;
    Some(Hit {
        pos: p.pos,
        layer: Layer::Balance,
        reason: Cow::Borrowed(p.reason.as_str()),
    })
}

#[cfg(test)]
mod tests;

pub use adaptive::{adaptive_verdict, Adaptive, Others, Verdict, COST_LOAD_CAP, COST_WAITING_CAP};
pub use affinity::{AffinityMode, AffinityStage, Escape};
pub use ctx::{CostTolerance, Hit, LayerCtx, Row, Stage};
pub use least_cached::LeastCachedStage;
pub use prefix::{Eligibility, PrefixLayerConfig, PrefixStage, PREFIX_SPILL};
pub use rendezvous::{RendezvousStage, RENDEZVOUS_PREFIX, RENDEZVOUS_SESSION};

/// Layered mode: the stages in order, then load balancing by `policy`. See the module docs.
pub struct FirstHit {
    policy: LbPolicy,
    stages: Vec<Box<dyn Stage>>,
    cost: Arc<CostModel>,
}

impl FirstHit {
    /// Load balancing alone (with a fresh cost model for `predicted-ttft`; the gateway shares
    /// its own through [`FirstHit::with_cost`]).
    pub fn balance(policy: LbPolicy) -> Self {
        FirstHit {
            policy,
            stages: Vec::new(),
            cost: Arc::new(CostModel::default()),
        }
    }

    /// Uses `model` for predicted TTFTs.
    pub fn with_cost(mut self, model: Arc<CostModel>) -> Self {
        self.cost = model;
        self
    }

    fn uses_cost(&self) -> bool {
        self.policy == LbPolicy::PredictedTtft || self.stages.iter().any(|s| s.uses_cost())
    }

    /// Adds a stage before the balancer (after the stages already added).
    pub fn then(mut self, stage: impl Stage + 'static) -> Self {
        self.stages.push(Box::new(stage));
        self
    }

    pub fn policy(&self) -> LbPolicy {
        self.policy
    }

    /// The stages' names, in order, then the balancer's (`affinity→prefix→least-token`).
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for st in &self.stages {
            s.push_str(st.name());
            s.push('→');
        }
        s.push_str(self.policy.as_str());
        s
    }
}

impl Picker for FirstHit {
    fn name(&self) -> &'static str {
        if self.stages.is_empty() {
            "balance"
        } else {
            "layered"
        }
    }

    fn needs(&self) -> Needs {
        let n = self.stages.iter().fold(Needs::NONE, |n, s| n | s.needs());
        // A predicted TTFT reads the prefix match (the uncached tokens).
        if self.uses_cost() {
            n | Needs::PREFIX
        } else {
            n
        }
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let n = cands.len();
        if n == 0 {
            return None;
        }
        let policy = self.policy;
        if self.stages.is_empty() && !req.explain && policy != LbPolicy::PredictedTtft {
            // Plain load balancing (hot path): no layer figures to compute.
            let p = balance::pick(policy, cands, req.turn)?;
            return Some(Decision {
                pos: p.pos,
                idx: cands[p.pos].idx,
                key: cands[p.pos].key,
                layer: Layer::Balance,
                reason: Cow::Borrowed(p.reason.as_str()),
                affinity: AffinityOutcome::Off,
                prompt_blocks: 0,
                matched_blocks: 0,
                best_matched_blocks: 0,
                trace: Trace::Layered(LayeredTrace {
                    policy,
                    avg_load: 0.0,
                    min_est: None,
                    notes: Vec::new(),
                    fallback: None,
                    rows: Vec::new(),
                }),
                dropped: Vec::new(),
            });
        }
        // On the stack for the usual fleet sizes (hot path: no allocation).
        let mut small = [Row::default(); 32];
        let mut big = Vec::new();
        let rows: &mut [Row] = if n <= small.len() {
            &mut small[..n]
        } else {
            big.resize(n, Row::default());
            &mut big
        };
        for (r, c) in rows.iter_mut().zip(cands) {
            *r = Row {
                load: policy.load_of(c),
                matched: req.matched(c),
                ineligible: false,
            };
        }
        let avg_load = rows.iter().map(|r| r.load as f64).sum::<f64>() / n as f64;
        let mut est_small = [Estimate::default(); 32];
        let mut est_big = Vec::new();
        let est: &mut [Estimate] = if !self.uses_cost() {
            &mut est_small[..0]
        } else if n <= est_small.len() {
            &mut est_small[..n]
        } else {
            est_big.resize(n, Estimate::default());
            &mut est_big
        };
        if !est.is_empty() {
            self.cost.estimate_all(req, cands, est);
            self.cost.utilization(cands, req.now_ms, est);
        }
        let min_est = est.iter().map(|e| e.ms).fold(f64::INFINITY, f64::min);
        let est: &[Estimate] = est;
        let mut cx = LayerCtx {
            req,
            cands,
            est,
            min_est,
            rng,
            policy,
            rows,
            avg_load,
            affinity: AffinityOutcome::Off,
            headline: None,
            notes: Vec::new(),
        };
        let mut hit = None;
        for st in &self.stages {
            if let Some(h) = st.try_pick(&mut cx) {
                hit = Some(h);
                break;
            }
        }
        let hit = match hit {
            Some(h) => h,
            None => balance_hit(policy, req, cands, est, min_est, cx.rng)?,
        };
        let (reason, fallback) = match cx.headline.take() {
            Some(h) => (h, Some(hit.reason)),
            None => (hit.reason, None),
        };
        let rows = if req.explain {
            (0..n)
                .map(|i| LayeredRow {
                    idx: cands[i].idx,
                    load: cx.rows[i].load,
                    waiting: cands[i].waiting,
                    matched: cx.rows[i].matched,
                    eligible: !cx.rows[i].ineligible,
                    est: est.get(i).copied(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Some(Decision {
            pos: hit.pos,
            idx: cands[hit.pos].idx,
            key: cands[hit.pos].key,
            layer: hit.layer,
            reason,
            affinity: cx.affinity,
            prompt_blocks: 0,
            matched_blocks: 0,
            best_matched_blocks: 0,
            trace: Trace::Layered(LayeredTrace {
                policy,
                avg_load: cx.avg_load,
                min_est: est.first().map(|_| min_est),
                notes: cx.notes,
                fallback,
                rows,
            }),
            dropped: Vec::new(),
        })
    }

    fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        for s in &self.stages {
            s.on_dispatch(req, chosen);
        }
    }

    fn on_complete(&self, req: &RequestView<'_>, chosen: &Candidate, done: &Completion) {
        for s in &self.stages {
            s.on_complete(req, chosen, done);
        }
    }
}
