//! `kind: decision-service` (routes only): the route's decision model names the target
//! that fits the request, and the candidates are restricted to it
//! ([`crate::filter::DecisionTarget`]; the gateway asks the model).

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams};

/// A filter, so it has no weight.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionServiceParams {
    /// Rejected with an explanation (a filter has no weight); kept so that the error
    /// names it instead of "unknown field".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl PluginParams for DecisionServiceParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn check(&self, p: &str, errs: &mut Vec<String>) {
        if self.weight.is_some() {
            errs.push(format!(
                "{p}.weight: decision-service has no weight: its answer restricts the candidates to the target it names (remove the weight)"
            ));
        }
    }

    fn build(&self, _ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::DecisionTarget
    }
}
