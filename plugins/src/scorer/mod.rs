//! Scorers: the policy picker's plugins ([`crate::policy::WeightedSum`]).
//!
//! A scorer writes one raw score per candidate (higher is better, ≥ 0). The policy picker
//! normalises each scorer's scores to sum 1 over the candidates and adds them up with the
//! configured weights. Scorers with state learn through `on_dispatch` / `on_complete`.
//!
//! A plugin is one file here: its parameters (the YAML keys next to `kind`, with their
//! defaults), their checks, and its logic; plus one line in [`registry!`] below, which
//! names its `kind`. The gateway parses `plugins: [{kind: …, …}]` into [`PluginSettings`],
//! checks each entry ([`PluginSettings::check`]) and builds it ([`PluginSettings::build`]);
//! nothing else matches on plugin kinds.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::CostModel;
use crate::pipeline::Completion;
use crate::session::SessionTable;

// The built-in plugins' types, by name (a new plugin needs no line here).
pub use decision_service::DecisionServiceParams;
pub use least_cached::{LeastCachedParams, LeastCachedScorer};
pub use least_inflight::{LeastInflightParams, LeastInflightScorer};
pub use least_token::{LeastTokenParams, LeastTokenScorer};
pub use predicted_ttft::{PredictedTtftParams, PredictedTtftScorer};
pub use prefix_cache::{PrefixCacheParams, PrefixScorer};
pub use session_affinity::{SessionAffinityParams, SessionAffinityScorer, UnboundSessions};

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

/// The plugin kinds, one line per plugin in the order error messages list them:
/// `file::Params => Variant = "kind"` declares the module `file` (this directory's `file.rs`)
/// and the `PluginSettings` variant of its parameters.
macro_rules! registry {
    ($($module:ident::$params:ident => $variant:ident = $kind:literal,)*) => {
        $(pub mod $module;)*

        /// A policy plugin: `kind` names it, the other keys are its own parameters.
        #[derive(Debug, Clone, Deserialize, Serialize)]
        #[serde(tag = "kind")]
        pub enum PluginSettings {
            $(
                #[serde(rename = $kind)]
                $variant($module::$params),
            )*
        }

        impl PluginSettings {
            /// The config name.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(PluginSettings::$variant(_) => $kind,)*
                }
            }

            fn params(&self) -> &dyn PluginParams {
                match self {
                    $(PluginSettings::$variant(p) => p,)*
                }
            }
        }
    };
}

registry! {
    session_affinity::SessionAffinityParams => SessionAffinity = "session-affinity",
    least_inflight::LeastInflightParams => LeastInflight = "least-inflight",
    least_token::LeastTokenParams => LeastToken = "least-token",
    predicted_ttft::PredictedTtftParams => PredictedTtft = "predicted-ttft",
    least_cached::LeastCachedParams => LeastCached = "least-cached",
    prefix_cache::PrefixCacheParams => PrefixCache = "prefix-cache",
    decision_service::DecisionServiceParams => DecisionService = "decision-service",
}

impl PluginSettings {
    /// The configured weight (`None`: default 1).
    pub fn weight(&self) -> Option<f64> {
        self.params().weight()
    }

    /// The plugin's own checks (see [`PluginParams::check`]).
    pub fn check(&self, p: &str, errs: &mut Vec<String>) {
        self.params().check(p, errs)
    }

    /// What the entry becomes in the pipeline.
    pub fn build(&self, ctx: &mut BuildCtx<'_>) -> Plugin {
        self.params().build(ctx)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::hash::InstanceKey;

    pub(crate) fn cands(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                idx: i,
                key: InstanceKey::of(&format!("i{i}")),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn every_kind_parses_with_its_defaults_and_prints_back() {
        for kind in [
            "session-affinity",
            "least-inflight",
            "least-token",
            "predicted-ttft",
            "least-cached",
            "prefix-cache",
            "decision-service",
        ] {
            let p: PluginSettings =
                serde_json::from_value(serde_json::json!({ "kind": kind })).unwrap();
            assert_eq!(p.kind(), kind);
            assert_eq!(p.weight(), None);
            let back = serde_json::to_value(&p).unwrap();
            assert_eq!(back["kind"], kind);
        }
    }
}
