//! `kind: least-token`: the fewest tokens in flight.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, RequestView};

/// `1 / (1 + in-flight tokens / token_scale)`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LeastTokenParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// Tokens that weigh as much as one request does for least-inflight (default 1000).
    #[serde(default = "d_token_scale")]
    pub token_scale: f64,
}

fn d_token_scale() -> f64 {
    1000.0
}

impl PluginParams for LeastTokenParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn check(&self, p: &str, errs: &mut Vec<String>) {
        if !(self.token_scale.is_finite() && self.token_scale > 0.0) {
            errs.push(format!("{p}.token_scale: must be a positive number"));
        }
    }

    fn build(&self, _ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::Scorer(Arc::new(LeastTokenScorer {
            token_scale: self.token_scale,
        }))
    }
}

/// Least in-flight tokens: `1 / (1 + inflight_tokens / token_scale)`. `token_scale` (default
/// 1000) is the token count that weighs as much as one request does for
/// [`LeastInflightScorer`]; without it a single token would count like a whole request.
#[derive(Clone, Copy, Debug)]
pub struct LeastTokenScorer {
    pub token_scale: f64,
}

impl Default for LeastTokenScorer {
    fn default() -> Self {
        LeastTokenScorer {
            token_scale: 1000.0,
        }
    }
}

impl Scorer for LeastTokenScorer {
    fn name(&self) -> &'static str {
        "tokens"
    }
    fn score(&self, _req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        let scale = if self.token_scale > 0.0 {
            self.token_scale
        } else {
            1.0
        };
        for (o, c) in out.iter_mut().zip(cands) {
            *o = 1.0 / (1.0 + c.inflight_tokens as f64 / scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::scorer::least_inflight::LeastInflightScorer;
    use super::*;
    use crate::scorer::api::cands;

    #[test]
    fn load_scorers() {
        let mut cs = cands(3);
        cs[0].inflight_requests = 1;
        cs[1].inflight_tokens = 1000;
        let mut out = vec![0.0; 3];
        LeastInflightScorer.score(&RequestView::default(), &cs, &mut out);
        assert_eq!(out, vec![0.5, 1.0, 1.0]);
        LeastTokenScorer::default().score(&RequestView::default(), &cs, &mut out);
        assert_eq!(out, vec![1.0, 0.5, 1.0]);
    }
}
