//! Layered mode: stages in order, the first that routes wins ([`FirstHit`]). The built-in
//! stages are session affinity → prefix cache, and load balancing always comes last; plain
//! load balancing is a [`FirstHit`] with no stage before the balancer.
//!
//! 1. **Session affinity** ([`AffinityStage`]): the [`SessionTable`] maps the session key
//!    to an instance.
//!    * `strict`: always the bound instance. If it is not among the candidates (gone,
//!      unhealthy, already tried), the lower layers choose and the session rebinds
//!      (`affinity-rebind`).
//!    * `soft`: the bound instance unless its load > average load over the candidates ×
//!      `soft_max_load_ratio` (default 1.5); then the lower layers choose and the session
//!      rebinds (`affinity-escape`). "Load" is the balancing figure ([`LbPolicy::load_of`]:
//!      in-flight tokens or requests).
//!    * The table's `ttl` and `max_entries` are the table's own ([`SessionTable`]).
//! 2. **Prefix cache** ([`PrefixStage`]): reads the prompt's match against the prefix index
//!    ([`RequestView::prefix`]); hit ratio = matched blocks / prompt blocks, per candidate. A
//!    candidate is eligible by its [`Eligibility`]: the gateway's default compares the cost
//!    of waiting for it with recomputing elsewhere plus the copy's placement ([`Adaptive`]);
//!    the fixed rule wants load ≤ average × (1 + `load_tolerance`, default 0.3) and waiting ≤
//!    `waiting_threshold` (default 2). The eligible candidate with the longest
//!    match wins (ties: lower load, then a rotation by `turn`) if its ratio ≥ `min_hit_ratio`
//!    (default 0.50); otherwise it is a miss. Reason `prefix(0.83)`, or `prefix-spill` when
//!    the adaptive rule moved a cached prompt away and a lower layer chose. Where the engines' cache
//!    sizes are known, an instance without room for the prompt next to its in-flight and
//!    recently completed requests ([`Candidate::kv_fits`]) is not eligible either, while
//!    another has room.
//! 3. **Least cached** (optional, [`LeastCachedStage`]): among the candidates with a near-best
//!    predicted TTFT (and with room in its KV cache, as above), the one the prefix index
//!    believes holds the fewest blocks. Reason `least-cached`.
//! 4. **Load balancing**: [`balance::pick`] with the picker's policy. Always routes.
//!
//! A stage is read-only while deciding; the gateway reports the dispatch
//! ([`Picker::on_dispatch`]: affinity binds the session) and the completion
//! ([`Picker::on_complete`]: affinity refreshes the binding). The prefix index itself is the
//! gateway's model of the engines' caches: it inserts every dispatched prompt, whatever the
//! scheduler.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;

use rand::{Rng, RngCore};

use crate::balance::{self, LbPolicy};
use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::{CostModel, Estimate};
use crate::decision::{AffinityOutcome, Decision, Layer, LayeredRow, LayeredTrace, Trace};
use crate::pipeline::{Completion, Outcome, Picker};
use crate::session::SessionTable;

/// What a stage sees: the request, the candidates, their load by the picker's balancing
/// figure, their prefix match, and the notes the stages leave for the explanation.
pub struct LayerCtx<'r, 'a> {
    pub req: &'r RequestView<'a>,
    pub cands: &'r [Candidate],
    /// Predicted TTFT per candidate (empty unless a stage or the balancer uses it).
    pub est: &'r [Estimate],
    /// The lowest of `est` (infinite when empty).
    pub min_est: f64,
    /// For random tie-breaks.
    pub rng: &'r mut dyn RngCore,
    /// The balancing figure (in-flight tokens or requests).
    pub policy: LbPolicy,
    /// Per candidate: its load, its match, whether a stage found it ineligible.
    pub rows: &'r mut [Row],
    pub avg_load: f64,
    /// Set by the affinity stage.
    pub affinity: AffinityOutcome,
    /// A stage that let the request fall through but must head its reason
    /// (`affinity-escape`, `affinity-rebind`).
    pub headline: Option<Cow<'static, str>>,
    /// One line per stage that has something to explain (only when `req.explain`).
    pub notes: Vec<String>,
}

impl LayerCtx<'_, '_> {
    /// Whether candidate `i`'s predicted TTFT is within `t` of the best one's.
    pub fn cost_eligible(&self, i: usize, t: &CostTolerance) -> bool {
        match self.est.get(i) {
            Some(e) => e.ms <= self.min_est * (1.0 + t.tolerance) + t.slack_ms,
            None => true,
        }
    }
}

/// How far above the best predicted TTFT a candidate may be and still be preferred for its
/// cache (prefix layer) or its session (soft affinity): `est ≤ best × (1 + tolerance) +
/// slack_ms`. The room is the value of keeping a prefix at its home: moving it costs a
/// recomputation there and evicts something else.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostTolerance {
    pub tolerance: f64,
    pub slack_ms: f64,
}

impl Default for CostTolerance {
    fn default() -> Self {
        CostTolerance {
            tolerance: 0.5,
            slack_ms: 50.0,
        }
    }
}

/// One candidate's figures in a [`LayerCtx`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Row {
    /// The balancing figure ([`LbPolicy::load_of`]).
    pub load: u64,
    /// Matched leading blocks (0 without a prefix match).
    pub matched: u32,
    /// A stage found it ineligible (shown in the explanation).
    pub ineligible: bool,
}

/// A stage's choice.
#[derive(Clone, Debug, PartialEq)]
pub struct Hit {
    /// Position in the candidates.
    pub pos: usize,
    pub layer: Layer,
    pub reason: Cow<'static, str>,
}

/// One layer of a [`FirstHit`] picker: routes the request, or lets it fall through.
pub trait Stage: Send + Sync {
    fn name(&self) -> &'static str;
    fn needs(&self) -> Needs {
        Needs::NONE
    }
    /// Reads the predicted TTFT ([`LayerCtx::est`]).
    fn uses_cost(&self) -> bool {
        false
    }
    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit>;
    fn on_dispatch(&self, _req: &RequestView<'_>, _chosen: &Candidate) {}
    fn on_complete(&self, _req: &RequestView<'_>, _chosen: &Candidate, _done: &Completion) {}
}

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
            None if policy == LbPolicy::PredictedTtft => {
                // The lowest predicted TTFT; exact ties at random.
                let tol = 1e-9 * min_est.abs().max(1e-9);
                let tied = est.iter().filter(|e| e.ms - min_est <= tol).count();
                let k = if tied > 1 {
                    cx.rng.gen_range(0..tied)
                } else {
                    0
                };
                let pos = (0..n).filter(|&i| est[i].ms - min_est <= tol).nth(k)?;
                Hit {
                    pos,
                    layer: Layer::Balance,
                    reason: Cow::Borrowed(policy.as_str()),
                }
            }
            None => {
                let p = balance::pick(policy, cands, req.turn)?;
                Hit {
                    pos: p.pos,
                    layer: Layer::Balance,
                    reason: Cow::Borrowed(p.reason.as_str()),
                }
            }
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

/// Strict or soft session affinity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AffinityMode {
    #[default]
    Soft,
    Strict,
}

impl AffinityMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityMode::Soft => "soft",
            AffinityMode::Strict => "strict",
        }
    }
}

/// When soft affinity leaves the bound instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Escape {
    /// Its load (the balancing figure) > average × this (`soft_max_load_ratio`, e.g. 1.5).
    Load(f64),
    /// Its predicted TTFT is not within this of the best candidate's.
    Cost(CostTolerance),
}

/// Layer 1: session affinity. See the module documentation.
#[derive(Debug)]
pub struct AffinityStage {
    pub mode: AffinityMode,
    /// Soft mode's escape rule.
    pub escape: Escape,
    sessions: Arc<SessionTable>,
}

impl AffinityStage {
    pub fn new(mode: AffinityMode, escape: Escape, sessions: Arc<SessionTable>) -> Self {
        AffinityStage {
            mode,
            escape,
            sessions,
        }
    }

    pub fn sessions(&self) -> &Arc<SessionTable> {
        &self.sessions
    }
}

impl Stage for AffinityStage {
    fn name(&self) -> &'static str {
        "affinity"
    }

    fn needs(&self) -> Needs {
        Needs::SESSION
    }

    fn uses_cost(&self) -> bool {
        self.mode == AffinityMode::Soft && matches!(self.escape, Escape::Cost(_))
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        let Some(s) = cx.req.session else {
            cx.affinity = AffinityOutcome::NoSession;
            return None;
        };
        let Some(bound) = self.sessions.get(s, cx.req.now_ms) else {
            cx.affinity = AffinityOutcome::Unbound;
            return None;
        };
        let Some(p) = cx.cands.iter().position(|c| c.key == bound) else {
            cx.affinity = AffinityOutcome::Rebind;
            cx.headline = Some(Cow::Borrowed(AffinityOutcome::Rebind.as_str()));
            return None;
        };
        let ok = match self.mode {
            AffinityMode::Strict => true,
            AffinityMode::Soft => match self.escape {
                Escape::Load(ratio) => {
                    let limit = cx.avg_load * ratio;
                    if cx.req.explain {
                        cx.notes
                            .push(format!("soft: bound load <= avg*ratio={limit:.1}"));
                    }
                    cx.rows[p].load as f64 <= limit
                }
                Escape::Cost(t) => {
                    if cx.req.explain {
                        cx.notes.push(format!(
                            "soft: bound est <= best*(1+{})+{}ms={:.0}ms",
                            t.tolerance,
                            t.slack_ms,
                            cx.min_est * (1.0 + t.tolerance) + t.slack_ms
                        ));
                    }
                    cx.cost_eligible(p, &t)
                }
            },
        };
        if ok {
            cx.affinity = AffinityOutcome::Hit;
            Some(Hit {
                pos: p,
                layer: Layer::Affinity,
                reason: Cow::Borrowed("affinity"),
            })
        } else {
            cx.affinity = AffinityOutcome::Escape;
            cx.headline = Some(Cow::Borrowed(AffinityOutcome::Escape.as_str()));
            None
        }
    }

    fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        if let Some(s) = req.session {
            self.sessions.bind(s, chosen.key, req.now_ms);
        }
    }

    fn on_complete(&self, req: &RequestView<'_>, _chosen: &Candidate, done: &Completion) {
        if let (Some(s), Outcome::Completed) = (req.session, done.outcome) {
            self.sessions.touch(s, req.now_ms);
        }
    }
}

/// The reason of a request whose prompt was cached on an instance the adaptive comparison
/// moved it away from ([`Adaptive`]); the explanation names the layer that then chose.
pub const PREFIX_SPILL: &str = "prefix-spill";

/// With cost eligibility, the prefix layer also skips an instance whose in-flight load is
/// above the average × (1 + this) ...
pub const COST_LOAD_CAP: f64 = 3.0;
/// ... or that has more requests waiting for their first token than this.
pub const COST_WAITING_CAP: u64 = 16;

/// Which candidates the prefix layer may prefer for their cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Eligibility {
    /// load ≤ average × (1 + `load_tolerance`) and waiting ≤ `waiting_threshold` (the fixed
    /// ratios of the original layered mode; defaults 0.3 and 2).
    Load {
        load_tolerance: f64,
        waiting_threshold: u64,
    },
    /// Predicted TTFT within a tolerance of the best candidate's (and under the safety caps
    /// [`COST_LOAD_CAP`], [`COST_WAITING_CAP`]).
    Cost(CostTolerance),
    /// Stay or move, by comparing costs ([`Adaptive`]): the default.
    Adaptive(Adaptive),
}

/// The default prefix eligibility: a candidate holding `m` blocks of the prompt is eligible
/// while waiting there costs no more than moving, i.e. while
///
/// ```text
///   est(holder)  <=  min over j holding less of  est(j) + placement × copy(j)
/// ```
///
/// * `est` — the predicted TTFT ([`CostModel`]): the queued prefill ahead of the request (ours
///   and, with engine metrics, others') at the instance's learned rate, plus its own uncached
///   part there, plus a decode step. On the holder the own part is small; on `j` it is the
///   recomputation of whatever `j` lacks.
/// * `copy(j)` — the placement term: the tokens the holder has and `j` would have to write,
///   at `j`'s rate. A copy elsewhere evicts as much of what `j` caches (someone else's prefix,
///   which its next turns recompute), so the move is charged for it once more, × `placement`.
///   Zero when `j`'s cache is known to have room for the prompt beside what was placed on it.
///
/// So the holder of a long prompt is waited for longer than the holder of a short one (moving
/// a long prompt recomputes and evicts more), and a hot tenant's prefix gets a second home
/// when its first has a queue longer than a recomputation plus a copy elsewhere — and not
/// before; once two instances hold it they share it (equal matches go to the lower load).
/// Nothing is a fixed count of requests: the figures are the fleet's own (learned rates,
/// queued tokens). The caps `load_tolerance` / `waiting_cap` are safety rails only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adaptive {
    /// Weight of the placement term (1 = a copy evicts as much as it writes, recomputed once).
    pub placement: f64,
    /// Never preferred when its load > average × (1 + this).
    pub load_tolerance: f64,
    /// Never preferred with more requests than this waiting for their first token.
    pub waiting_cap: u64,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            placement: 1.0,
            load_tolerance: COST_LOAD_CAP,
            waiting_cap: COST_WAITING_CAP,
        }
    }
}

/// What the adaptive comparison said about one holder ([`Adaptive`]).
#[derive(Clone, Copy, Debug)]
struct Verdict {
    /// The holder's predicted TTFT, ms.
    stay_ms: f64,
    /// The cheapest move: its candidate, its predicted TTFT and its placement term, ms.
    to: Option<(usize, f64, f64)>,
}

impl Verdict {
    fn stays(&self) -> bool {
        self.to
            .is_none_or(|(_, est, copy)| self.stay_ms <= est + copy)
    }
}

/// The adaptive comparison for candidate `i` (which holds `cx.rows[i].matched` blocks).
fn adaptive_verdict(cx: &LayerCtx<'_, '_>, a: &Adaptive, i: usize, any_fits: bool) -> Verdict {
    let m = cx.rows[i].matched;
    let bt = cx.req.block_tokens.max(1) as f64;
    let prompt = cx.req.prompt_tokens;
    let mut to: Option<(usize, f64, f64)> = None;
    for (j, c) in cx.cands.iter().enumerate() {
        let mj = cx.rows[j].matched;
        if j == i || mj >= m || (any_fits && !c.kv_fits(prompt)) {
            continue;
        }
        let Some(e) = cx.est.get(j) else { continue };
        let room = c.cache_tokens > 0
            && c.placed_blocks.saturating_mul(cx.req.block_tokens) + prompt <= c.cache_tokens;
        let copy = if room {
            0.0
        } else {
            a.placement.max(0.0) * f64::from(m - mj) * bt * 1000.0 / e.tps.max(1.0)
        };
        if to.is_none_or(|(_, est, cp)| e.ms + copy < est + cp) {
            to = Some((j, e.ms, copy));
        }
    }
    Verdict {
        stay_ms: cx.est.get(i).map_or(0.0, |e| e.ms),
        to,
    }
}

/// Layer 2 settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixLayerConfig {
    /// Below this hit ratio it is a miss. Default 0.50 with load eligibility, 0 with cost.
    pub min_hit_ratio: f64,
    pub eligibility: Eligibility,
}

impl Default for PrefixLayerConfig {
    /// The original fixed ratios: min hit 0.5, load tolerance 0.3, waiting threshold 2.
    fn default() -> Self {
        PrefixLayerConfig {
            min_hit_ratio: 0.50,
            eligibility: Eligibility::Load {
                load_tolerance: 0.3,
                waiting_threshold: 2,
            },
        }
    }
}

/// Marks the candidates whose engine's KV cache would not hold this prompt next to its
/// in-flight and recently completed requests ([`Candidate::kv_fits`]; only those whose cache
/// size is known) as ineligible, with a note saying so — unless no candidate has room.
fn kv_check(cx: &mut LayerCtx<'_, '_>, layer: &str) {
    let prompt = cx.req.prompt_tokens;
    if !cx.cands.iter().any(|c| c.kv_fits(prompt)) {
        // Every cache is full (the fleet's working set is larger than its caches): moving
        // the request would not make room anywhere, only cost its prefix.
        return;
    }
    let mut full = String::new();
    for (r, c) in cx.rows.iter_mut().zip(cx.cands) {
        if !c.kv_fits(prompt) {
            r.ineligible = true;
            if cx.req.explain {
                let _ = write!(
                    full,
                    " #{}({}+{}+{prompt}>{})",
                    c.idx, c.inflight_tokens, c.recent_tokens, c.cache_tokens
                );
            }
        }
    }
    if !full.is_empty() {
        cx.notes.push(format!(
            "{layer}: kv cache full (in-flight + recently done + prompt > cache_tokens):{full}"
        ));
    }
}

/// Layer 2: the prefix cache. See the module documentation.
#[derive(Clone, Debug, Default)]
pub struct PrefixStage(pub PrefixLayerConfig);

impl Stage for PrefixStage {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn needs(&self) -> Needs {
        Needs::PREFIX
    }

    fn uses_cost(&self) -> bool {
        matches!(
            self.0.eligibility,
            Eligibility::Cost(_) | Eligibility::Adaptive(_)
        )
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        let p = &self.0;
        let n = cx.cands.len();
        let prompt_blocks = cx.req.prompt_blocks();
        // The longest-match holder the adaptive comparison moved away from (for the reason).
        let mut spilled: Option<usize> = None;
        match p.eligibility {
            Eligibility::Adaptive(a) => {
                let limit = cx.avg_load * (1.0 + a.load_tolerance);
                if cx.req.explain {
                    cx.notes.push(format!(
                        "prefix: eligible if est <= min over those holding less of (est + copy*{}) && load <= avg*(1+{})={limit:.1} && waiting <= {}, hit if matched/{prompt_blocks} >= {:.2}, longest match wins (tie: lower load)",
                        a.placement, a.load_tolerance, a.waiting_cap, p.min_hit_ratio
                    ));
                }
                let prompt = cx.req.prompt_tokens;
                let any_fits = cx.cands.iter().any(|c| c.kv_fits(prompt));
                let best_m = cx.rows.iter().map(|r| r.matched).max().unwrap_or(0);
                let mut said = String::new();
                for i in 0..n {
                    if cx.rows[i].load as f64 > limit || cx.cands[i].waiting > a.waiting_cap {
                        cx.rows[i].ineligible = true;
                        continue;
                    }
                    if cx.rows[i].matched == 0 {
                        continue;
                    }
                    let v = adaptive_verdict(cx, &a, i, any_fits);
                    if !v.stays() {
                        cx.rows[i].ineligible = true;
                        if cx.rows[i].matched == best_m
                            && spilled.is_none_or(|s| cx.rows[i].load < cx.rows[s].load)
                        {
                            spilled = Some(i);
                        }
                    }
                    if cx.req.explain {
                        let (verb, term) = if v.stays() {
                            ("stays", "wait")
                        } else {
                            ("moves", "recompute+placement")
                        };
                        match v.to {
                            Some((j, est, copy)) => {
                                let _ = write!(
                                    said,
                                    " #{}:{verb}({term}: {:.0}ms vs #{} {est:.0}+copy {copy:.0}ms)",
                                    cx.cands[i].idx, v.stay_ms, cx.cands[j].idx
                                );
                            }
                            None => {
                                let _ =
                                    write!(said, " #{}:stays(nowhere holds less)", cx.cands[i].idx);
                            }
                        }
                    }
                }
                if !said.is_empty() {
                    cx.notes.push(format!("prefix: holders:{said}"));
                }
            }
            Eligibility::Load {
                load_tolerance,
                waiting_threshold,
            } => {
                let limit = cx.avg_load * (1.0 + load_tolerance);
                if cx.req.explain {
                    let mut s = String::new();
                    let _ = write!(
                        s,
                        "prefix: eligible if load <= avg*(1+tol)={limit:.1} && waiting <= {waiting_threshold}, hit if matched/{prompt_blocks} >= {:.2}, longest match wins (tie: lower load)",
                        p.min_hit_ratio
                    );
                    cx.notes.push(s);
                }
                for (r, c) in cx.rows.iter_mut().zip(cx.cands) {
                    if !(r.load as f64 <= limit && c.waiting <= waiting_threshold) {
                        r.ineligible = true;
                    }
                }
            }
            Eligibility::Cost(t) => {
                // The predicted TTFT sees queued prefill work, not what a hot instance's
                // running batch does to its KV cache: a cap on in-flight load keeps one
                // instance from taking so much that it evicts the prefixes it was chosen for.
                let limit = cx.avg_load * (1.0 + COST_LOAD_CAP);
                if cx.req.explain {
                    cx.notes.push(format!(
                        "prefix: eligible if est <= best*(1+{})+{}ms={:.0}ms && load <= avg*(1+{COST_LOAD_CAP})={limit:.1} && waiting <= {COST_WAITING_CAP}, hit if matched/{prompt_blocks} >= {:.2}, longest match wins (tie: lower load)",
                        t.tolerance,
                        t.slack_ms,
                        cx.min_est * (1.0 + t.tolerance) + t.slack_ms,
                        p.min_hit_ratio
                    ));
                }
                for i in 0..n {
                    if !cx.cost_eligible(i, &t)
                        || cx.rows[i].load as f64 > limit
                        || cx.cands[i].waiting > COST_WAITING_CAP
                    {
                        cx.rows[i].ineligible = true;
                    }
                }
            }
        }
        kv_check(cx, "prefix");
        if prompt_blocks == 0 {
            return None;
        }
        let start = (cx.req.turn % n as u64) as usize;
        let mut best: Option<usize> = None;
        for step in 0..n {
            let i = (start + step) % n;
            let r = &cx.rows[i];
            if r.ineligible {
                continue;
            }
            let better = match best {
                None => true,
                Some(b) => {
                    let o = &cx.rows[b];
                    (r.matched, std::cmp::Reverse(r.load)) > (o.matched, std::cmp::Reverse(o.load))
                }
            };
            if better {
                best = Some(i);
            }
        }
        let hit = best.and_then(|b| {
            let m = cx.rows[b].matched;
            let ratio = f64::from(m) / f64::from(prompt_blocks);
            (m > 0 && ratio >= p.min_hit_ratio).then(|| Hit {
                pos: b,
                layer: Layer::Prefix,
                reason: Cow::Owned(format!("prefix({ratio:.2})")),
            })
        });
        if hit.is_none() && cx.headline.is_none() {
            let prompt = cx.req.prompt_tokens;
            let any_fits = cx.cands.iter().any(|c| c.kv_fits(prompt));
            // A holder without KV room would not have been chosen anyway: that check's note
            // explains it, the reason stays the lower layer's.
            let spill = |s: usize| {
                f64::from(cx.rows[s].matched) / f64::from(prompt_blocks) >= p.min_hit_ratio
                    && (cx.cands[s].kv_fits(prompt) || !any_fits)
            };
            if spilled.is_some_and(spill) {
                // The prompt is cached, but waiting for its holder costs more than
                // recomputing it elsewhere plus the copy's placement: the layers below choose.
                cx.headline = Some(Cow::Borrowed(PREFIX_SPILL));
            }
        }
        hit
    }
}

/// Layer 3 (optional): where a request goes when no instance is preferred for its session or
/// its cache — a new tenant's first request, a one-shot with an unseen prompt, a session whose
/// cached instance was too busy. Among the candidates whose predicted TTFT is within the
/// tolerance of the best, the one the gateway has placed the fewest blocks on
/// ([`Candidate::placed_blocks`]: what the prefix index believes it holds, plus what a
/// cache-size bound made the index forget — where the bound applies, every busy instance's
/// held blocks sit at its cache size); ties: lower load, then a rotation. Whatever lands there
/// will be cached there, so cold prompts fill the emptiest caches first and the fleet's
/// caches hold more distinct prefixes between them, rather than whichever instance was
/// momentarily least loaded taking a hot new tenant next to its other hot ones. Reason
/// `least-cached`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastCachedStage(pub CostTolerance);

impl Stage for LeastCachedStage {
    fn name(&self) -> &'static str {
        "least-cached"
    }

    fn needs(&self) -> Needs {
        Needs::PREFIX
    }

    fn uses_cost(&self) -> bool {
        true
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        let n = cx.cands.len();
        let t = self.0;
        if cx.req.explain {
            cx.notes.push(format!(
                "least-cached: eligible if est <= best*(1+{})+{}ms={:.0}ms, fewest cached blocks wins (tie: lower load)",
                t.tolerance,
                t.slack_ms,
                cx.min_est * (1.0 + t.tolerance) + t.slack_ms,
            ));
        }
        let prompt = cx.req.prompt_tokens;
        let any_fits = (0..n).any(|i| cx.cost_eligible(i, &t) && cx.cands[i].kv_fits(prompt));
        if any_fits && cx.req.explain {
            kv_check(cx, "least-cached");
        }
        let start = (cx.req.turn % n as u64) as usize;
        let mut best: Option<usize> = None;
        for step in 0..n {
            let i = (start + step) % n;
            if !cx.cost_eligible(i, &t) || (any_fits && !cx.cands[i].kv_fits(prompt)) {
                continue;
            }
            let key = |j: usize| (cx.cands[j].placed_blocks, cx.rows[j].load);
            if best.is_none_or(|b| key(i) < key(b)) {
                best = Some(i);
            }
        }
        best.map(|pos| Hit {
            pos,
            layer: Layer::Balance,
            reason: Cow::Borrowed("least-cached"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::hash::{InstanceKey, SessionKey};
    use crate::pipeline::Pipeline;
    use crate::prefix::{PrefixIndex, PrefixMatch};
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn cand(i: usize, req: u64, tok: u64, waiting: u64) -> Candidate {
        Candidate {
            idx: i,
            inflight_requests: req,
            inflight_tokens: tok,
            waiting,
            key: InstanceKey::of(&format!("inst-{i}")),
            ..Default::default()
        }
    }

    fn idle(n: usize) -> Vec<Candidate> {
        (0..n).map(|i| cand(i, 0, 0, 0)).collect()
    }

    struct Fixture {
        sessions: Arc<SessionTable>,
        index: PrefixIndex,
        p: Pipeline,
    }

    impl Fixture {
        fn new(policy: LbPolicy, affinity: Option<AffinityMode>, prefix: bool) -> Self {
            let sessions = Arc::new(SessionTable::default());
            let mut fh = FirstHit::balance(policy);
            if let Some(mode) = affinity {
                fh = fh.then(AffinityStage::new(
                    mode,
                    Escape::Load(1.5),
                    sessions.clone(),
                ));
            }
            if prefix {
                fh = fh.then(PrefixStage::default());
            }
            Fixture {
                sessions,
                index: PrefixIndex::default(),
                p: Pipeline::new(fh),
            }
        }

        /// Decides like the gateway does: match the prompt, pick, explain.
        fn decide(&self, req: &RequestView<'_>, cands: &[Candidate]) -> Option<Decision> {
            let m: PrefixMatch = self.index.match_prefix(req.blocks, req.now_ms);
            let r = RequestView {
                prefix: Some(&m),
                explain: true,
                ..*req
            };
            self.p.pick(&r, cands, &mut StdRng::seed_from_u64(0))
        }

        /// Dispatches like the gateway does: the pipeline learns, the index records.
        fn dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
            self.p.on_dispatch(req, chosen);
            self.index.insert(req.blocks, chosen.key, req.now_ms);
        }
    }

    fn req<'a>(session: &str, blocks: &'a [u64], now_ms: u64, turn: u64) -> RequestView<'a> {
        RequestView {
            session: Some(SessionKey::of(session)),
            blocks,
            now_ms,
            turn,
            ..Default::default()
        }
    }

    fn blocks(b: &[u64]) -> RequestView<'_> {
        RequestView {
            blocks: b,
            ..Default::default()
        }
    }

    #[test]
    fn least_cached_sends_a_cold_prompt_to_the_emptiest_cache_that_is_not_far_slower() {
        let fh = FirstHit::balance(LbPolicy::LeastToken)
            .then(PrefixStage::default())
            .then(LeastCachedStage(CostTolerance {
                tolerance: 0.5,
                slack_ms: 50.0,
            }));
        let p = Pipeline::new(fh);
        let pick = |cs: &[Candidate]| {
            // 1,000 uncached tokens: 125 ms at the prior 8,000 tokens/s (+ a 20 ms step).
            let r = RequestView {
                blocks: &[1, 2, 3],
                prompt_tokens: 1000,
                block_tokens: 16,
                explain: true,
                ..Default::default()
            };
            p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap()
        };
        let mut cs = idle(3);
        for (c, held) in cs.iter_mut().zip([100, 10, 50]) {
            c.placed_blocks = held;
        }
        cs[2].inflight_tokens = 1; // least-token would pick 0 or 1 by rotation, never by cache
        let d = pick(&cs);
        assert_eq!((d.idx, d.reason.as_ref()), (1, "least-cached"));
        // Instance 1 has 1,000 ms of prefill queued: far above the best (145 ms): not eligible.
        cs[1].prefill_tokens = 8000;
        let d = pick(&cs);
        assert_eq!(d.idx, 2, "{d:?}");
        // Equal caches: the lower load.
        cs[0].placed_blocks = 50;
        cs[0].inflight_tokens = 5;
        assert_eq!(pick(&cs).idx, 2);
        cs[2].inflight_tokens = 9;
        assert_eq!(pick(&cs).idx, 0);
        // 60 ms queued on the emptiest (1) keeps it within 145 × 1.5 + 50 ms: still preferred.
        cs[1].prefill_tokens = 480;
        assert_eq!(pick(&cs).idx, 1);
    }

    #[test]
    fn empty_candidates_is_none() {
        let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
        assert!(f.decide(&RequestView::default(), &[]).is_none());
    }

    #[test]
    fn only_load_balancing_when_no_layer_is_configured() {
        let f = Fixture::new(LbPolicy::LeastToken, None, false);
        assert_eq!(f.p.mode(), "balance");
        let mut cs = idle(3);
        cs[0].inflight_tokens = 50;
        let d = f.decide(&req("s", &[1, 2], 0, 0), &cs).unwrap();
        assert_eq!(
            (d.pos, d.layer, d.reason.as_ref()),
            (1, Layer::Balance, "least-token")
        );
        assert_eq!(d.affinity, AffinityOutcome::Off);
        assert_eq!(
            (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
            (2, 0, 0)
        );
    }

    #[test]
    fn a_new_session_falls_through_then_sticks() {
        let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
        assert_eq!(f.p.needs(), Needs::SESSION | Needs::PREFIX);
        let cs = idle(3);
        let r = req("conv", &[], 0, 1);
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!(d.affinity, AffinityOutcome::Unbound);
        assert_eq!(d.reason, "least-request");
        f.dispatch(&r, &cs[d.pos]);
        for turn in 2..10 {
            let d2 = f.decide(&req("conv", &[], 1000, turn), &cs).unwrap();
            assert_eq!((d2.pos, d2.reason.as_ref()), (d.pos, "affinity"));
        }
    }

    #[test]
    fn soft_affinity_escapes_an_overloaded_instance_and_rebinds() {
        let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
        let mut cs = idle(3);
        let r = req("conv", &[], 0, 0);
        f.dispatch(&r, &cs[0]);
        // avg = 4/3, limit 2.0: 2 in flight stays …
        cs[0].inflight_requests = 2;
        cs[1].inflight_requests = 2;
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
        // … 3 in flight (avg 1, limit 1.5) escapes to the least loaded.
        cs[0].inflight_requests = 3;
        cs[1].inflight_requests = 0;
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!(d.affinity, AffinityOutcome::Escape);
        assert_eq!(d.reason, "affinity-escape");
        assert_ne!(d.pos, 0);
        assert!(
            d.explain().contains("then=least-request"),
            "{}",
            d.explain()
        );
        f.dispatch(&r, &cs[d.pos]);
        assert_eq!(
            f.sessions.get(SessionKey::of("conv"), 0),
            Some(cs[d.pos].key)
        );
    }

    #[test]
    fn strict_affinity_ignores_load_and_rebinds_when_the_instance_is_gone() {
        let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Strict), true);
        let mut cs = idle(3);
        let r = req("conv", &[], 0, 0);
        f.dispatch(&r, &cs[2]);
        cs[2].inflight_requests = 100;
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (2, "affinity"));
        // Instance 2 failed / left: it is not a candidate any more.
        let d = f.decide(&r, &cs[..2]).unwrap();
        assert_eq!(
            (d.reason.as_ref(), d.affinity),
            ("affinity-rebind", AffinityOutcome::Rebind)
        );
        f.dispatch(&r, &cs[d.pos]);
        let d2 = f.decide(&r, &cs).unwrap();
        assert_eq!((d2.pos, d2.reason.as_ref()), (d.pos, "affinity"));
    }

    #[test]
    fn affinity_expires_after_the_ttl_and_refreshes_only_on_success() {
        let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Strict), true);
        let cs = idle(2);
        f.dispatch(&req("c", &[], 0, 0), &cs[1]);
        let d = f.decide(&req("c", &[], 1_800_000, 0), &cs).unwrap();
        assert_eq!(d.reason, "affinity");
        // A failed request does not refresh the binding …
        f.p.on_complete(
            &req("c", &[], 1_800_000, 0),
            &cs[1],
            &Completion::of(Outcome::Failed),
        );
        assert!(f.sessions.get(SessionKey::of("c"), 1_800_001).is_none());
        // … a completed one does.
        f.dispatch(&req("c", &[], 0, 0), &cs[1]);
        f.p.on_complete(
            &req("c", &[], 1_800_000, 0),
            &cs[1],
            &Completion::of(Outcome::Completed),
        );
        let d = f.decide(&req("c", &[], 3_600_000, 0), &cs).unwrap();
        assert_eq!(d.reason, "affinity");
        let d = f.decide(&req("c", &[], 5_400_001, 0), &cs).unwrap();
        assert_eq!(d.affinity, AffinityOutcome::Unbound);
    }

    #[test]
    fn a_full_kv_cache_is_not_chosen_by_the_prefix_or_least_cached_layers() {
        // A load tolerance that never bites: only the KV room decides here.
        let fh = FirstHit::balance(LbPolicy::LeastToken)
            .then(PrefixStage(PrefixLayerConfig {
                min_hit_ratio: 0.5,
                eligibility: Eligibility::Load {
                    load_tolerance: 10.0,
                    waiting_threshold: 2,
                },
            }))
            .then(LeastCachedStage(CostTolerance {
                tolerance: 0.5,
                slack_ms: 50.0,
            }));
        let p = Pipeline::new(fh);
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (1..=12).collect();
        let mut cs = idle(3);
        index.insert(&prompt, cs[0].key, 0);
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prompt_tokens: 192,
            block_tokens: 16,
            prefix: Some(&m),
            explain: true,
            ..Default::default()
        };
        let pick = |cs: &[Candidate]| p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap();
        // Sizes unknown: the holder, whatever its in-flight tokens.
        cs[0].inflight_tokens = 900;
        assert_eq!(pick(&cs).reason, "prefix(1.00)");
        // 1,000-token caches: 900 in flight + 192 do not fit on 0; least-cached takes the
        // emptier of the others, 2.
        cs[0].placed_blocks = 12;
        cs[1].placed_blocks = 40;
        for c in &mut cs {
            c.cache_tokens = 1000;
        }
        let d = pick(&cs);
        assert_eq!((d.idx, d.reason.as_ref()), (2, "least-cached"));
        let e = d.explain();
        assert!(e.contains("prefix: kv cache full (in-flight + recently done + prompt > cache_tokens): #0(900+0+192>1000)"), "{e}");
        assert!(
            e.contains("#0:load=900,wait=0,match=12(1.00)") && e.contains(",ineligible #1:"),
            "{e}"
        );
        // It fits exactly: back to the holder.
        cs[0].inflight_tokens = 808;
        assert_eq!(pick(&cs).reason, "prefix(1.00)");
        // Recently completed requests count too (their sessions come back soon).
        cs[0].recent_tokens = 1;
        assert_eq!(pick(&cs).idx, 2);
        // When no cache has room, moving the request makes none: the prefix holder again.
        for c in &mut cs {
            c.inflight_tokens = 950;
        }
        let d = pick(&cs);
        assert_eq!((d.idx, d.reason.as_ref()), (0, "prefix(1.00)"));
        assert!(!d.explain().contains("kv cache full"), "{}", d.explain());
        // And a prompt no cache holds goes by blocks alone (2 holds none).
        let other: Vec<u64> = (100..112).collect();
        let m = index.match_prefix(&other, 0);
        let r = RequestView {
            blocks: &other,
            prefix: Some(&m),
            ..r
        };
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((d.idx, d.reason.as_ref()), (2, "least-cached"));
    }

    #[test]
    fn prefix_routes_to_the_longest_eligible_match() {
        let f = Fixture::new(LbPolicy::LeastRequest, None, true);
        let mut cs = idle(4);
        let prompt: Vec<u64> = (1..=12).collect();
        // inst 1 holds 10/12, inst 2 holds 12/12 but is overloaded, inst 3 holds 5/12.
        f.dispatch(&blocks(&prompt[..10]), &cs[1]);
        f.dispatch(&blocks(&prompt), &cs[2]);
        f.dispatch(&blocks(&prompt[..5]), &cs[3]);
        for (i, l) in [1, 2, 9, 0].iter().enumerate() {
            cs[i].inflight_requests = *l; // avg 3, limit 3.9
        }
        let r = blocks(&prompt);
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!(
            (d.pos, d.layer, d.reason.as_ref()),
            (1, Layer::Prefix, "prefix(0.83)")
        );
        assert_eq!(
            (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
            (12, 10, 12)
        );
        let e = d.explain();
        eprintln!("{e}");
        assert!(
            e.contains("#2:load=9,wait=0,match=12(1.00),ineligible"),
            "{e}"
        );
        assert!(e.contains("*#1:load=2"), "{e}");
        // Too many waiting also makes it ineligible.
        cs[1].waiting = 3;
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!(d.reason, "least-request"); // inst 3's 5/12 < 0.50 → miss
        assert_eq!(d.pos, 3);
        assert_eq!(d.best_matched_blocks, 12);
    }

    #[test]
    fn equal_matches_go_to_the_lower_load() {
        let f = Fixture::new(LbPolicy::LeastToken, None, true);
        let mut cs = idle(3);
        let prompt = [7u64, 8, 9, 10];
        for c in &cs {
            f.dispatch(&blocks(&prompt), c);
        }
        cs[0].inflight_tokens = 300;
        cs[1].inflight_tokens = 100;
        cs[2].inflight_tokens = 200;
        for turn in 0..3 {
            let r = RequestView {
                blocks: &prompt,
                turn,
                ..Default::default()
            };
            let d = f.decide(&r, &cs).unwrap();
            assert_eq!((d.pos, d.reason.as_ref()), (1, "prefix(1.00)"));
        }
    }

    #[test]
    fn affinity_wins_over_prefix_but_reports_the_prefix_numbers() {
        let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
        let cs = idle(2);
        let prompt = [1u64, 2, 3, 4];
        f.dispatch(&req("x", &prompt, 0, 0), &cs[1]);
        f.dispatch(&req("y", &prompt[..1], 0, 0), &cs[0]);
        let d = f.decide(&req("y", &prompt, 0, 0), &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
        assert_eq!(
            (d.matched_blocks, d.best_matched_blocks, d.prompt_blocks),
            (1, 4, 4)
        );
    }

    #[test]
    fn filters_run_before_the_layers_and_say_what_they_dropped() {
        let sessions = Arc::new(SessionTable::default());
        let p = Pipeline::new(
            FirstHit::balance(LbPolicy::LeastRequest).then(AffinityStage::new(
                AffinityMode::Strict,
                Escape::Load(1.5),
                sessions.clone(),
            )),
        )
        .filter(crate::filter::Available)
        .filter(crate::filter::NotTried);
        let mut cs = idle(4);
        cs[0].available = false;
        let s = SessionKey::of("s");
        sessions.bind(s, cs[1].key, 0);
        let tried = [cs[1].key];
        let r = RequestView {
            session: Some(s),
            exclude: &tried,
            explain: true,
            ..Default::default()
        };
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        // The bound instance was tried: rebind to one of the two left.
        assert_eq!(d.reason, "affinity-rebind");
        assert!(d.pos == 2 || d.pos == 3, "{d:?}");
        let e = d.explain();
        assert!(e.contains("filtered out: #0(unavailable) #1(tried)"), "{e}");
        // Nothing left: no decision.
        cs[2].available = false;
        cs[3].available = false;
        assert!(p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).is_none());
    }

    fn cost_pipeline(model: &Arc<CostModel>, prefix: Option<CostTolerance>) -> Pipeline {
        let mut fh = FirstHit::balance(LbPolicy::PredictedTtft).with_cost(model.clone());
        if let Some(t) = prefix {
            fh = fh.then(PrefixStage(PrefixLayerConfig {
                min_hit_ratio: 0.0,
                eligibility: Eligibility::Cost(t),
            }));
        }
        Pipeline::new(fh)
    }

    fn with_queue(i: usize, prefill_tokens: u64) -> Candidate {
        Candidate {
            prefill_tokens,
            ..cand(i, 0, 0, 0)
        }
    }

    #[test]
    fn predicted_ttft_balancing_picks_the_lowest_estimate_ties_at_random() {
        let model = Arc::new(CostModel::new(crate::cost::CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 10.0,
            ..Default::default()
        }));
        let p = cost_pipeline(&model, None);
        assert_eq!(p.needs(), Needs::PREFIX);
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (0..32).collect(); // 512 tokens
        let cs = [with_queue(0, 900), with_queue(1, 300), with_queue(2, 800)];
        index.insert(&prompt, cs[2].key, 0); // 2 holds it: 800 + 0 beats 300 + 512
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: 512,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (2, "predicted-ttft"));
        let e = d.explain();
        assert!(e.contains("best_est=810ms"), "{e}");
        assert!(
            e.contains("*#2:load=0,wait=0,match=32(1.00),est=810ms(q=800+own=0+dec=10"),
            "{e}"
        );
        // Equal estimates: every candidate is chosen sometimes.
        let idle = [with_queue(0, 0), with_queue(1, 0), with_queue(2, 0)];
        let r0 = RequestView {
            prompt_tokens: 512,
            block_tokens: 16,
            ..Default::default()
        };
        let mut seen = [0; 3];
        for seed in 0..60 {
            let d = p
                .pick(&r0, &idle, &mut StdRng::seed_from_u64(seed))
                .unwrap();
            seen[d.pos] += 1;
        }
        assert!(seen.iter().all(|&x| x > 5), "{seen:?}");
    }

    #[test]
    fn the_cost_prefix_layer_keeps_a_prefix_home_within_the_tolerance() {
        let model = Arc::new(CostModel::new(crate::cost::CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 0.0,
            ..Default::default()
        }));
        let t = CostTolerance {
            tolerance: 0.5,
            slack_ms: 0.0,
        };
        let p = cost_pipeline(&model, Some(t));
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (0..64).collect(); // 1024 tokens
        let holder = cand(0, 0, 0, 0);
        index.insert(&prompt, holder.key, 0);
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: 1024,
            block_tokens: 16,
            ..Default::default()
        };
        // The holder has 1,200 tokens queued (est 1.2 s); an idle other instance would need
        // 1.024 s: pure cost would move the prefix, the tolerance (≤ 1.54 s) keeps it home.
        let cs = [with_queue(0, 1200), with_queue(1, 0)];
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (0, "prefix(1.00)"));
        // A long queue (2 s > 1.54 s) does move it.
        let cs = [with_queue(0, 2000), with_queue(1, 0)];
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (1, "predicted-ttft"));
    }

    #[test]
    fn soft_affinity_can_escape_by_cost() {
        let model = Arc::new(CostModel::new(crate::cost::CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 0.0,
            ..Default::default()
        }));
        let sessions = Arc::new(SessionTable::default());
        let t = CostTolerance {
            tolerance: 0.0,
            slack_ms: 100.0,
        };
        let p = Pipeline::new(
            FirstHit::balance(LbPolicy::PredictedTtft)
                .with_cost(model)
                .then(AffinityStage::new(
                    AffinityMode::Soft,
                    Escape::Cost(t),
                    sessions.clone(),
                )),
        );
        let s = SessionKey::of("s");
        let cs = [with_queue(0, 50), with_queue(1, 0)];
        sessions.bind(s, cs[0].key, 0);
        let r = RequestView {
            session: Some(s),
            prompt_tokens: 100,
            block_tokens: 16,
            ..Default::default()
        };
        // 150 ms vs 100 ms: within the 100 ms slack, the session stays.
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
        let cs = [with_queue(0, 500), with_queue(1, 0)];
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (1, "affinity-escape"));
    }

    #[test]
    fn the_cost_prefix_layer_skips_a_holder_above_the_load_caps() {
        let model = Arc::new(CostModel::new(crate::cost::CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 10.0,
            ..Default::default()
        }));
        let loose = CostTolerance {
            tolerance: 100.0,
            slack_ms: 1e6,
        };
        let p = cost_pipeline(&model, Some(loose));
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (0..32).collect();
        let m = |cs: &[Candidate]| {
            index.insert(&prompt, cs[0].key, 0);
            index.match_prefix(&prompt, 0)
        };
        // #0 holds the prompt; its estimate is within any tolerance. Under the caps: a hit.
        let cs = [
            cand(0, 3, 3000, 2),
            cand(1, 1, 1000, 0),
            cand(2, 1, 1000, 0),
        ];
        let pm = m(&cs);
        let r = RequestView {
            blocks: &prompt,
            prefix: Some(&pm),
            prompt_tokens: 512,
            block_tokens: 16,
            ..Default::default()
        };
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!(d.pos, 0);
        assert!(d.reason.starts_with("prefix"), "{}", d.reason);
        // In-flight tokens above the average × (1 + COST_LOAD_CAP): not chosen for its cache
        // (the balancing layer decides, by predicted TTFT).
        // (With n candidates one holds at most n × the average: six here.)
        let mut cs = vec![cand(0, 9, 90_000, 2)];
        cs.extend((1..6).map(|i| cand(i, 1, 1000, 0)));
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert!(!d.reason.starts_with("prefix"), "{}", d.reason);
        // More than COST_WAITING_CAP requests waiting: the same.
        let cs = [
            cand(0, 20, 3000, COST_WAITING_CAP + 1),
            cand(1, 1, 1000, 0),
            cand(2, 1, 1000, 0),
        ];
        let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert!(!d.reason.starts_with("prefix"), "{}", d.reason);
    }

    /// The default pipeline's layers over a cost model at 1,000 tokens/s and no decode step:
    /// a predicted TTFT in ms is the number of tokens to prefill.
    fn adaptive_pipeline() -> Pipeline {
        let model = Arc::new(CostModel::new(crate::cost::CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 0.0,
            ..Default::default()
        }));
        Pipeline::new(
            FirstHit::balance(LbPolicy::LeastToken)
                .with_cost(model)
                .then(PrefixStage(PrefixLayerConfig {
                    min_hit_ratio: 0.1,
                    eligibility: Eligibility::Adaptive(Adaptive::default()),
                }))
                .then(LeastCachedStage(CostTolerance::default())),
        )
    }

    fn queued(i: usize, prefill_tokens: u64, waiting: u64) -> Candidate {
        Candidate {
            prefill_tokens,
            waiting,
            inflight_tokens: prefill_tokens,
            inflight_requests: waiting,
            ..cand(i, 0, 0, 0)
        }
    }

    #[test]
    fn a_long_prompt_waits_longer_for_its_holder_than_a_short_one() {
        let p = adaptive_pipeline();
        // The queue on the holder (#0) at which a prompt it holds whole stops going there.
        let spill_at = |blocks: u64| -> u64 {
            let index = PrefixIndex::default();
            let prompt: Vec<u64> = (0..blocks).collect();
            let holder = cand(0, 0, 0, 0);
            index.insert(&prompt, holder.key, 0);
            let m = index.match_prefix(&prompt, 0);
            let r = RequestView {
                blocks: &prompt,
                prefix: Some(&m),
                prompt_tokens: blocks * 16,
                block_tokens: 16,
                explain: true,
                ..Default::default()
            };
            for q in (0..20_000).step_by(100) {
                let cs = [queued(0, q, q / 1000), queued(1, 0, 0), queued(2, 0, 0)];
                let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
                if d.pos != 0 {
                    assert_eq!(d.reason, PREFIX_SPILL, "{}", d.explain());
                    let e = d.explain();
                    assert!(e.contains("#0:moves(recompute+placement: "), "{e}");
                    return q;
                }
                assert_eq!(d.reason, "prefix(1.00)", "{}", d.explain());
            }
            panic!("never left the holder");
        };
        let short = spill_at(16); // 256 tokens: recompute 256 ms + placement 256 ms
        let long = spill_at(256); // 4,096 tokens
        assert_eq!(short, 600, "the first queue above 512 ms");
        assert_eq!(long, 8200, "the first queue above 8,192 ms");
        // (8 waiting there at the end: four times the old fixed limit of 2.)
        assert!(long > short);
    }

    #[test]
    fn a_hot_tenants_second_home_opens_when_its_first_is_saturated_and_not_before() {
        let p = adaptive_pipeline();
        let index = PrefixIndex::default();
        // The tenant's system prompt: 128 blocks (2,048 tokens); each request adds 32 blocks
        // of its own (512 tokens), different every time.
        let system: Vec<u64> = (0..128).collect();
        let mut cs: Vec<Candidate> = (0..4).map(|i| queued(i, 0, 0)).collect();
        index.insert(&system, cs[0].key, 0);
        let mut next = 1_000u64;
        let mut send = |cs: &mut Vec<Candidate>| {
            let mut prompt = system.clone();
            prompt.extend(next..next + 32);
            next += 32;
            let m = index.match_prefix(&prompt, 0);
            let r = RequestView {
                blocks: &prompt,
                prefix: Some(&m),
                prompt_tokens: 160 * 16,
                block_tokens: 16,
                explain: true,
                ..Default::default()
            };
            let d = p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap();
            // Dispatch: the chosen instance queues the tokens it does not hold.
            let c = &mut cs[d.pos];
            let own = r.uncached_tokens(c);
            c.prefill_tokens += own;
            c.inflight_tokens += own;
            c.waiting += 1;
            c.inflight_requests += 1;
            index.insert(&prompt, c.key, 0);
            (d.pos, d.reason.to_string(), d.explain())
        };
        // Moving costs 2,560 ms (the whole prompt elsewhere) + 2,048 ms (the copy of the
        // system prompt there): the holder keeps the tenant while waiting there (its queue +
        // 512 ms) costs no more — 9 requests waiting, where the old fixed limit was 2.
        for k in 0..8 {
            let (pos, why, e) = send(&mut cs);
            assert_eq!((pos, why.as_str()), (0, "prefix(0.80)"), "request {k}: {e}");
        }
        assert_eq!(cs[0].prefill_tokens, 4096);
        assert!(cs[1..].iter().all(|c| c.waiting == 0));
        // 4,096 + 512 = 4,608: equal costs stay.
        let (pos, why, e) = send(&mut cs);
        assert_eq!((pos, why.as_str()), (0, "prefix(0.80)"), "{e}");
        // Now the holder is saturated: the next request goes elsewhere (the emptiest cache)
        // and says why.
        let (home2, why, e) = send(&mut cs);
        assert_ne!(home2, 0, "{e}");
        assert_eq!(why, PREFIX_SPILL, "{e}");
        assert!(e.contains("then=least-cached"), "{e}");
        assert!(
            e.contains("#0:moves(recompute+placement: 5120ms vs #"),
            "{e}"
        );
        // The tenant has two homes now: its requests go to the second while the first drains,
        // by the prefix (not another spill), and no third home opens.
        for k in 0..4 {
            let (pos, why, e) = send(&mut cs);
            assert_eq!(
                (pos, why.as_str()),
                (home2, "prefix(0.80)"),
                "request {k}: {e}"
            );
        }
        let homes = cs.iter().filter(|c| c.waiting > 0).count();
        assert_eq!(homes, 2);
        // When the first home drains, the tenant uses it again (equal matches: lower load).
        cs[0].prefill_tokens = 0;
        cs[0].inflight_tokens = 0;
        cs[0].waiting = 0;
        let (pos, why, _) = send(&mut cs);
        assert_eq!((pos, why.as_str()), (0, "prefix(0.80)"));
    }

    #[test]
    fn the_adaptive_prefix_layer_keeps_its_safety_caps_and_copies_into_free_room_freely() {
        let p = adaptive_pipeline();
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (0..64).collect(); // 1,024 tokens
        let mut cs: Vec<Candidate> = (0..3).map(|i| queued(i, 0, 0)).collect();
        index.insert(&prompt, cs[0].key, 0);
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: 1024,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        let pick = |cs: &[Candidate]| p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap();
        // 1,500 queued: below 1,024 + 1,024 → stays.
        cs[0] = queued(0, 1500, 3);
        assert_eq!(pick(&cs).reason, "prefix(1.00)");
        // The others' caches are known to have room: a copy evicts nothing, only the
        // recomputation (1,024 ms) counts, and 1,500 ms is more.
        for c in &mut cs[1..] {
            c.cache_tokens = 100_000;
        }
        let d = pick(&cs);
        assert_eq!(d.reason, PREFIX_SPILL, "{}", d.explain());
        assert!(d.explain().contains("+copy 0ms"), "{}", d.explain());
        // Waiting above the cap: not chosen for its cache, whatever the costs (the layers
        // below decide; this is no spill).
        let mut cs: Vec<Candidate> = (0..3).map(|i| queued(i, 0, 0)).collect();
        cs[0] = queued(0, 100, COST_WAITING_CAP + 1);
        let d = pick(&cs);
        assert_eq!(d.reason, "least-cached", "{}", d.explain());
        let e = d.explain();
        assert!(e.contains("wait=17,match=64(1.00),est=100ms"), "{e}");
        assert!(e.contains("@1.0k/s),ineligible #1:"), "{e}");
    }
}
