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

use serde::{Deserialize, Serialize};

mod api;

pub use api::{BuildCtx, Plugin, PluginParams, Scorer};

// The built-in plugins' types, by name (a new plugin needs no line here).
pub use decision_service::DecisionServiceParams;
pub use least_cached::{LeastCachedParams, LeastCachedScorer};
pub use least_inflight::{LeastInflightParams, LeastInflightScorer};
pub use least_token::{LeastTokenParams, LeastTokenScorer};
pub use predicted_ttft::{PredictedTtftParams, PredictedTtftScorer};
pub use prefix_cache::{PrefixCacheParams, PrefixScorer};
pub use session_affinity::{SessionAffinityParams, SessionAffinityScorer, UnboundSessions};

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
    least_waiting::LeastWaitingParams => LeastWaiting = "least-waiting",
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
mod tests {
    use super::*;

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
