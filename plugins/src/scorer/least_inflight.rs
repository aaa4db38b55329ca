//! `kind: least-inflight`: the fewest requests in flight.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, RequestView};

/// `1 / (1 + in-flight requests)`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LeastInflightParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl PluginParams for LeastInflightParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn build(&self, _ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::Scorer(Arc::new(LeastInflightScorer))
    }
}

/// Least in-flight requests: `1 / (1 + inflight_requests)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastInflightScorer;

impl Scorer for LeastInflightScorer {
    fn name(&self) -> &'static str {
        "inflight"
    }
    fn score(&self, _req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = 1.0 / (1.0 + c.inflight_requests as f64);
        }
    }
}
