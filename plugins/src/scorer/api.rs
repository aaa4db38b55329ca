//! What every plugin file implements and uses: the [`Scorer`] trait, its parameters'
//! [`PluginParams`], and what building one may use ([`BuildCtx`]).

use std::sync::Arc;

use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::{CostModel, Estimate};
use crate::pipeline::Completion;
use crate::session::SessionTable;

/// A scoring plugin. Higher is better; scores must be finite and ≥ 0 (anything else counts
/// as 0). `out` has one slot per candidate and arrives zeroed.
pub trait Scorer: Send + Sync {
    fn name(&self) -> &'static str;
    /// The inputs it reads beyond the candidates' load.
    fn needs(&self) -> Needs {
        Needs::NONE
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]);
    /// Before any plugin scores: clear `keep[i]` to take candidate `i` out of this decision
    /// (the policy picker scores the others; a filter that would leave none is ignored).
    /// Most plugins only score.
    fn filter(&self, _req: &RequestView<'_>, _cands: &[Candidate], _keep: &mut [bool]) {}
    /// Whether [`Self::filter`] can take anything out (the policy skips the filter pass, and
    /// its allocations, when no plugin does).
    fn filters(&self) -> bool {
        false
    }
    /// The request was sent to `chosen`.
    fn on_dispatch(&self, _req: &RequestView<'_>, _chosen: &Candidate) {}
    /// The request to `chosen` finished.
    fn on_complete(&self, _req: &RequestView<'_>, _chosen: &Candidate, _done: &Completion) {}
    /// For an explained decision: the predicted TTFT of every candidate and whether the
    /// prompt is cold (held nowhere), from a plugin that estimates them.
    fn estimates(
        &self,
        _req: &RequestView<'_>,
        _cands: &[Candidate],
    ) -> Option<(bool, Vec<Estimate>)> {
        None
    }
}

/// What a plugin entry becomes in the policy pipeline.
pub enum Plugin {
    /// A scorer, summed with the entry's weight.
    Scorer(Arc<dyn Scorer>),
    /// The decision service's target filter ([`crate::filter::DecisionTarget`]): the route's
    /// decision model names the target the candidates are restricted to.
    DecisionTarget,
}

/// What building a plugin may use: the predicted-TTFT model and the scheduler's session
/// table (created on first use, so a scheduler without a session plugin has none).
pub struct BuildCtx<'a> {
    pub cost: &'a Arc<CostModel>,
    sessions: &'a mut dyn FnMut() -> Arc<SessionTable>,
}

impl<'a> BuildCtx<'a> {
    pub fn new(
        cost: &'a Arc<CostModel>,
        sessions: &'a mut dyn FnMut() -> Arc<SessionTable>,
    ) -> Self {
        BuildCtx { cost, sessions }
    }

    /// The scheduler's session table.
    pub fn sessions(&mut self) -> Arc<SessionTable> {
        (self.sessions)()
    }
}

/// A plugin's parameters: the keys of its `plugins:` entry besides `kind`.
pub trait PluginParams {
    /// The configured `weight` (`None`: 1).
    fn weight(&self) -> Option<f64>;
    /// Checks the plugin's own parameters; `p` is the entry's YAML path (`…plugins[2]`) and
    /// each error starts with it.
    fn check(&self, _p: &str, _errs: &mut Vec<String>) {}
    /// The pipeline part the entry becomes.
    fn build(&self, ctx: &mut BuildCtx<'_>) -> Plugin;
}

/// Candidates `i0`, `i1`, … for the plugins' tests.
#[cfg(test)]
pub(crate) fn cands(n: usize) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            idx: i,
            key: crate::hash::InstanceKey::of(&format!("i{i}")),
            ..Default::default()
        })
        .collect()
}
