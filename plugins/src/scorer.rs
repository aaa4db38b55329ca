//! The scoring framework shared by both pickers: the per-request view, the [`Scorer`]
//! trait, and the built-in scorers.
//!
//! A scorer writes one raw score per candidate (higher is better, ≥ 0). The policy picker
//! normalises each scorer's scores to sum 1 over the candidates and adds them up with the
//! configured weights; the layered picker uses the same state (session table, prefix index)
//! through its layers. Scorers with state learn through `on_dispatch` / `on_complete`.

use std::sync::Arc;

use crate::balance::Candidate;
use crate::hash::{rendezvous, SessionKey};
use crate::prefix::{PrefixIndex, PrefixMatch};
use crate::session::SessionTable;

/// What a picker needs to know about one request. Cheap to build: all borrowed or `Copy`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestView<'a> {
    /// The session key the gateway chose from its key chain (`SessionKey::of(str)`).
    pub session: Option<SessionKey>,
    /// The prompt's chained block hashes ([`crate::hash::block_hashes`]).
    pub blocks: &'a [u64],
    /// The caller's clock, milliseconds.
    pub now_ms: u64,
    /// A per-service request counter: drives round-robin and rotating tie-breaks.
    pub turn: u64,
    /// The decision service's answer: `Some(target)` (the candidates' `target` number) or
    /// `None` for abstain / not asked.
    pub decision: Option<u32>,
    /// The prefix match, when the picker already computed it (saves a second lookup).
    pub prefix: Option<&'a PrefixMatch>,
}

/// A scoring plugin. Higher is better; scores must be finite and ≥ 0 (anything else counts
/// as 0). `out` has one slot per candidate and arrives zeroed.
pub trait Scorer: Send + Sync {
    fn name(&self) -> &'static str;
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]);
    /// The request was sent to `chosen`.
    fn on_dispatch(&self, _req: &RequestView<'_>, _chosen: &Candidate) {}
    /// The request to `chosen` finished successfully.
    fn on_complete(&self, _req: &RequestView<'_>, _chosen: &Candidate) {}
}

/// Session affinity: `2^-r` where `r` is the candidate's rank in the session's preference
/// order — the bound instance first (r = 0), then the others by rendezvous hash of
/// (session, instance), a fixed order per session. No session key: abstain (all 0).
/// Binds the session to the chosen instance on dispatch.
#[derive(Debug)]
pub struct SessionAffinityScorer {
    sessions: Arc<SessionTable>,
}

impl SessionAffinityScorer {
    pub fn new(sessions: Arc<SessionTable>) -> Self {
        SessionAffinityScorer { sessions }
    }
}

impl Scorer for SessionAffinityScorer {
    fn name(&self) -> &'static str {
        "affinity"
    }

    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        let Some(s) = req.session else {
            return;
        };
        let bound = self.sessions.get(s, req.now_ms);
        // (is not the bound one, rendezvous weight descending, key) — a total order.
        let mut order: Vec<(bool, std::cmp::Reverse<u64>, u64, usize)> = cands
            .iter()
            .enumerate()
            .map(|(pos, c)| {
                (
                    Some(c.key) != bound,
                    std::cmp::Reverse(rendezvous(s, c.key)),
                    c.key.0,
                    pos,
                )
            })
            .collect();
        order.sort_unstable();
        for (rank, o) in order.iter().enumerate() {
            out[o.3] = 0.5f64.powi(rank.min(1000) as i32);
        }
    }

    fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        if let Some(s) = req.session {
            self.sessions.bind(s, chosen.key, req.now_ms);
        }
    }

    fn on_complete(&self, req: &RequestView<'_>, _chosen: &Candidate) {
        if let Some(s) = req.session {
            self.sessions.touch(s, req.now_ms);
        }
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

/// Prefix cache: the fraction of the prompt's blocks the candidate holds. Inserts the prompt
/// for the chosen instance on dispatch; refreshes it on completion.
///
/// A match below `min_hit_ratio` (default 0.5) scores 0, as in layered mode's prefix layer.
/// Without that floor, sum-normalisation would turn any match into a full score: when every
/// prompt starts with the same short system prompt, the first instance that served one
/// would hold a tiny match on every request, score 1.0 against everyone else's 0, and win
/// every request however loaded it is (seen on the Mooncake trace: 7 of 8 engines idle).
#[derive(Debug)]
pub struct PrefixScorer {
    index: Arc<PrefixIndex>,
    min_hit_ratio: f64,
}

impl PrefixScorer {
    pub fn new(index: Arc<PrefixIndex>) -> Self {
        PrefixScorer {
            index,
            min_hit_ratio: 0.5,
        }
    }
    /// Matches below this share of the prompt score 0.
    pub fn with_min_hit_ratio(mut self, r: f64) -> Self {
        self.min_hit_ratio = r;
        self
    }
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }
}

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        "prefix"
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        if req.blocks.is_empty() {
            return;
        }
        let own;
        let m = match req.prefix {
            Some(m) => m,
            None => {
                own = self.index.match_prefix(req.blocks, req.now_ms);
                &own
            }
        };
        for (o, c) in out.iter_mut().zip(cands) {
            let r = m.ratio(c.key);
            *o = if r >= self.min_hit_ratio { r } else { 0.0 };
        }
    }
    fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        self.index.insert(req.blocks, chosen.key, req.now_ms);
    }
    fn on_complete(&self, req: &RequestView<'_>, chosen: &Candidate) {
        self.index.touch(req.blocks, chosen.key, req.now_ms);
    }
}

/// Decision service: 1 for candidates of the target the service named, 0 for the others;
/// abstains (all 0, which the policy picker treats as "no opinion") when it did not answer.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecisionScorer;

impl Scorer for DecisionScorer {
    fn name(&self) -> &'static str {
        "decision"
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        if let Some(t) = req.decision {
            for (o, c) in out.iter_mut().zip(cands) {
                *o = if c.target == t { 1.0 } else { 0.0 };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::InstanceKey;

    fn cands(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                idx: i,
                key: InstanceKey::of(&format!("i{i}")),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn affinity_ranks_bound_first_then_a_fixed_order_per_session() {
        let t = Arc::new(SessionTable::default());
        let sc = SessionAffinityScorer::new(t.clone());
        let cs = cands(5);
        let s = SessionKey::of("conv-1");
        let req = RequestView {
            session: Some(s),
            ..Default::default()
        };
        let mut out = vec![0.0; 5];
        sc.score(&req, &cs, &mut out);
        let mut sorted = out.clone();
        sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
        assert_eq!(sorted, vec![1.0, 0.5, 0.25, 0.125, 0.0625]);
        // Binding moves that instance to rank 0; the order of the rest is unchanged.
        t.bind(s, cs[3].key, 0);
        let mut out2 = vec![0.0; 5];
        sc.score(&req, &cs, &mut out2);
        assert_eq!(out2[3], 1.0);
        let rest = |o: &[f64]| {
            let mut v: Vec<usize> = (0..5).filter(|&i| i != 3).collect();
            v.sort_by(|&a, &b| o[b].partial_cmp(&o[a]).unwrap());
            v
        };
        assert_eq!(rest(&out), rest(&out2));
        // The order does not depend on the candidates' positions.
        let mut rev = cs.clone();
        rev.reverse();
        let mut out3 = vec![0.0; 5];
        sc.score(&req, &rev, &mut out3);
        for i in 0..5 {
            assert_eq!(out3[4 - i], out2[i]);
        }
        // No session: abstain.
        let mut z = vec![0.0; 5];
        sc.score(&RequestView::default(), &cs, &mut z);
        assert!(z.iter().all(|&x| x == 0.0));
    }

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

    #[test]
    fn decision_scorer_names_a_target_or_abstains() {
        let mut cs = cands(3);
        cs[2].target = 1;
        let mut out = vec![0.0; 3];
        DecisionScorer.score(
            &RequestView {
                decision: Some(1),
                ..Default::default()
            },
            &cs,
            &mut out,
        );
        assert_eq!(out, vec![0.0, 0.0, 1.0]);
        let mut out = vec![0.0; 3];
        DecisionScorer.score(&RequestView::default(), &cs, &mut out);
        assert_eq!(out, vec![0.0; 3]);
    }

    #[test]
    fn prefix_scorer_scores_the_hit_ratio_and_learns_on_dispatch() {
        let ix = Arc::new(PrefixIndex::default());
        let sc = PrefixScorer::new(ix.clone());
        let cs = cands(2);
        let blocks = [1, 2, 3, 4];
        let req = RequestView {
            blocks: &blocks,
            ..Default::default()
        };
        sc.on_dispatch(
            &RequestView {
                blocks: &blocks[..3],
                ..Default::default()
            },
            &cs[1],
        );
        let mut out = vec![0.0; 2];
        sc.score(&req, &cs, &mut out);
        assert_eq!(out, vec![0.0, 0.75]);
    }

    #[test]
    fn a_short_shared_prefix_does_not_pull_every_request_to_one_instance() {
        // Every prompt starts with the same system block; instance 0 served one first.
        let ix = Arc::new(PrefixIndex::default());
        let sc = PrefixScorer::new(ix.clone());
        let cs = cands(4);
        sc.on_dispatch(
            &RequestView {
                blocks: &[7, 1],
                ..Default::default()
            },
            &cs[0],
        );
        let blocks: Vec<u64> = std::iter::once(7).chain(100..120).collect();
        let mut out = vec![0.0; 4];
        sc.score(
            &RequestView {
                blocks: &blocks,
                ..Default::default()
            },
            &cs,
            &mut out,
        );
        // 1 of 21 blocks (< min_hit_ratio 0.5): no opinion, so load decides.
        assert_eq!(out, vec![0.0; 4]);
        let low = PrefixScorer::new(ix).with_min_hit_ratio(0.0);
        low.score(
            &RequestView {
                blocks: &blocks,
                ..Default::default()
            },
            &cs,
            &mut out,
        );
        assert!(out[0] > 0.0);
    }
}
