//! `kind: prefix-cache`: the share of the prompt cached on the instance.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, Needs, RequestView};

/// Share of the prompt cached on the instance; matches below `min_hit_ratio` score 0, and
/// so does an instance with more than `max_waiting` requests waiting for their first token.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixCacheParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    #[serde(default = "d_min_hit")]
    pub min_hit_ratio: f64,
    /// Unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<u64>,
}

fn d_min_hit() -> f64 {
    0.5
}

impl PluginParams for PrefixCacheParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn check(&self, p: &str, errs: &mut Vec<String>) {
        if !(0.0..=1.0).contains(&self.min_hit_ratio) {
            errs.push(format!("{p}.min_hit_ratio: must be in [0, 1]"));
        }
    }

    fn build(&self, _ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::Scorer(Arc::new(PrefixScorer {
            min_hit_ratio: self.min_hit_ratio,
            max_waiting: self.max_waiting,
        }))
    }
}

/// Prefix cache: the fraction of the prompt's blocks the candidate holds, from the request's
/// prefix match ([`RequestView::prefix`]; the gateway keeps the index).
///
/// A match below `min_hit_ratio` (default 0.5) scores 0, as in layered mode's prefix layer.
/// Without that floor, sum-normalisation would turn any match into a full score: when every
/// prompt starts with the same short system prompt, the first instance that served one
/// would hold a tiny match on every request, score 1.0 against everyone else's 0, and win
/// every request however loaded it is (seen on the Mooncake trace: 7 of 8 engines idle).
///
/// With `max_waiting`, a candidate with more requests waiting for their first token scores 0
/// too (the layered prefix layer's `waiting_threshold`): a hot prefix's holder stops pulling
/// new requests to itself once it has a queue, and the other plugins spread them.
#[derive(Clone, Copy, Debug)]
pub struct PrefixScorer {
    pub min_hit_ratio: f64,
    pub max_waiting: Option<u64>,
}

impl Default for PrefixScorer {
    fn default() -> Self {
        PrefixScorer {
            min_hit_ratio: 0.5,
            max_waiting: None,
        }
    }
}

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        "prefix"
    }
    fn needs(&self) -> Needs {
        Needs::PREFIX
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        let Some(m) = req.prefix else { return };
        if m.prompt_blocks == 0 {
            return;
        }
        for (o, c) in out.iter_mut().zip(cands) {
            let r = m.ratio(c.key);
            let queued = self.max_waiting.is_some_and(|w| c.waiting > w);
            *o = if r >= self.min_hit_ratio && !queued {
                r
            } else {
                0.0
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::PrefixIndex;
    use crate::scorer::api::cands;

    #[test]
    fn prefix_scorer_scores_the_hit_ratio_of_the_match() {
        let ix = PrefixIndex::default();
        let cs = cands(2);
        let blocks = [1, 2, 3, 4];
        ix.insert(&blocks[..3], cs[1].key, 0);
        let m = ix.match_prefix(&blocks, 0);
        let req = RequestView {
            blocks: &blocks,
            prefix: Some(&m),
            ..Default::default()
        };
        let mut out = vec![0.0; 2];
        PrefixScorer::default().score(&req, &cs, &mut out);
        assert_eq!(out, vec![0.0, 0.75]);
        // With max_waiting: the holder scores 0 once more than that many wait there.
        let mut cs = cs;
        cs[1].waiting = 3;
        let capped = |w| PrefixScorer {
            max_waiting: Some(w),
            ..Default::default()
        };
        capped(3).score(&req, &cs, &mut out);
        assert_eq!(out, vec![0.0, 0.75]);
        capped(2).score(&req, &cs, &mut out);
        assert_eq!(out, vec![0.0, 0.0]);
        // No match computed: abstain.
        let mut out = vec![0.0; 2];
        PrefixScorer::default().score(&RequestView::default(), &cs, &mut out);
        assert_eq!(out, vec![0.0; 2]);
    }

    #[test]
    fn a_short_shared_prefix_does_not_pull_every_request_to_one_instance() {
        // Every prompt starts with the same system block; instance 0 served one first.
        let ix = PrefixIndex::default();
        let cs = cands(4);
        ix.insert(&[7, 1], cs[0].key, 0);
        let blocks: Vec<u64> = std::iter::once(7).chain(100..120).collect();
        let m = ix.match_prefix(&blocks, 0);
        let req = RequestView {
            blocks: &blocks,
            prefix: Some(&m),
            ..Default::default()
        };
        let mut out = vec![0.0; 4];
        PrefixScorer::default().score(&req, &cs, &mut out);
        // 1 of 21 blocks (< min_hit_ratio 0.5): no opinion, so load decides.
        assert_eq!(out, vec![0.0; 4]);
        PrefixScorer {
            min_hit_ratio: 0.0,
            ..Default::default()
        }
        .score(&req, &cs, &mut out);
        assert!(out[0] > 0.0);
    }
}
