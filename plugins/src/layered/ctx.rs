//! What the stages share: the context a stage decides in ([`LayerCtx`]), its figures per
//! candidate, the [`Stage`] trait and the cost tolerance.

use std::borrow::Cow;

use rand::RngCore;

use crate::balance::LbPolicy;
use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::Estimate;
use crate::decision::{AffinityOutcome, Layer};
use crate::pipeline::Completion;

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

/// One layer of a [`FirstHit`](super::FirstHit) picker: routes the request, or lets it fall through.
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
