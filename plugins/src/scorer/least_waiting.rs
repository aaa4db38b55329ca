//! `kind: least-waiting`: the shortest prefill queue — the fewest requests waiting for their
//! first token (this gateway's, or the engine's own count when it is scraped and larger).
//!
//! Added as the example of a plugin being its file: this file and one `registry!` line in
//! `scorer/mod.rs` are the whole change (no config, validation or pipeline code).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, RequestView};

/// `1 / (1 + waiting)`. Unlike `least-inflight` it does not count requests that are already
/// decoding: those delay a new request's first token by a decode step, a queue of prefills by
/// all of their prompts.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LeastWaitingParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl PluginParams for LeastWaitingParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn build(&self, _ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::Scorer(Arc::new(LeastWaitingScorer))
    }
}

/// The fewest requests waiting for a first token: `1 / (1 + waiting)`, `waiting` the larger of
/// this gateway's count and the engine's reported queue.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastWaitingScorer;

impl Scorer for LeastWaitingScorer {
    fn name(&self) -> &'static str {
        "waiting"
    }
    fn score(&self, _req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(cands) {
            let engine = c.engine.map_or(0, |e| u64::from(e.waiting));
            *o = 1.0 / (1.0 + c.waiting.max(engine) as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::EngineLoad;

    #[test]
    fn the_shortest_prefill_queue_scores_highest_whoever_queued_it() {
        let c = |waiting: u64, inflight: u64, engine: Option<u32>| Candidate {
            waiting,
            inflight_requests: inflight,
            engine: engine.map(|w| EngineLoad {
                waiting: w,
                ..Default::default()
            }),
            ..Default::default()
        };
        // Decoding load does not count; the engine's own queue does when it is the larger.
        let cands = [c(0, 30, None), c(2, 2, None), c(0, 0, Some(4))];
        let mut out = [0.0; 3];
        LeastWaitingScorer.score(&RequestView::default(), &cands, &mut out);
        assert_eq!(out, [1.0, 1.0 / 3.0, 1.0 / 5.0]);
    }
}
