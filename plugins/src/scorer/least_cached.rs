//! `kind: least-cached`: the emptiest cache.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, Needs, RequestView};

/// `2^-r`, `r` = how many candidates hold fewer cached blocks (by the prefix index).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LeastCachedParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl PluginParams for LeastCachedParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn build(&self, _ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::Scorer(Arc::new(LeastCachedScorer))
    }
}

/// Least cached: `2^-r` where `r` is the number of candidates the gateway placed fewer blocks
/// on ([`Candidate::placed_blocks`]): the emptiest cache scores 1, equal caches score the same.
/// Policy mode's counterpart of the layered mode's least-cached layer: with a small weight it
/// decides where a prompt no instance holds goes (a new tenant, a one-shot), so that cold
/// prompts fill the emptiest caches; the affinity and prefix plugins outweigh it for a prompt
/// that is cached somewhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastCachedScorer;

impl Scorer for LeastCachedScorer {
    fn name(&self) -> &'static str {
        "least-cached"
    }
    fn needs(&self) -> Needs {
        Needs::PREFIX
    }
    fn score(&self, _req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(cands) {
            let fewer = cands
                .iter()
                .filter(|d| d.placed_blocks < c.placed_blocks)
                .count();
            *o = 0.5f64.powi(fewer.min(1000) as i32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::api::cands;

    #[test]
    fn least_cached_ranks_by_placed_blocks_and_ties_equal_caches() {
        let mut cs = cands(4);
        for (c, b) in cs.iter_mut().zip([30, 0, 30, 5]) {
            c.placed_blocks = b;
        }
        let mut out = vec![0.0; 4];
        LeastCachedScorer.score(&RequestView::default(), &cs, &mut out);
        assert_eq!(out, vec![0.25, 1.0, 0.25, 0.5]);
        // All empty: all equal (the plugin then adds nothing after normalisation).
        for c in &mut cs {
            c.placed_blocks = 0;
        }
        LeastCachedScorer.score(&RequestView::default(), &cs, &mut out);
        assert_eq!(out, vec![1.0; 4]);
    }
}
