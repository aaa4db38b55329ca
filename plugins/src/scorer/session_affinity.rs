//! `kind: session-affinity`: keeps a session on the instance it is bound to.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, Needs, RequestView};
use crate::hash::rendezvous;
use crate::pipeline::{Completion, Outcome};
use crate::session::SessionTable;

/// `2^-rank` in the session's preference order (bound instance first).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SessionAffinityParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// A session with no binding (or bound to an instance that is not a candidate):
    /// `rendezvous` (default) ranks the instances by a per-session hash; `abstain` scores
    /// nothing, so the other plugins place it (where its tenant's prefix is cached, …).
    #[serde(default)]
    pub unbound: UnboundSessions,
}

/// What `session-affinity` scores for a session that is not bound to a candidate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnboundSessions {
    /// A fixed per-session order of the instances (rendezvous hash).
    #[default]
    Rendezvous,
    /// No score: the other plugins decide.
    Abstain,
}

impl PluginParams for SessionAffinityParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn build(&self, ctx: &mut BuildCtx<'_>) -> Plugin {
        Plugin::Scorer(Arc::new(
            SessionAffinityScorer::new(ctx.sessions())
                .abstain_unbound(self.unbound == UnboundSessions::Abstain),
        ))
    }
}

/// Session affinity: `2^-r` where `r` is the candidate's rank in the session's preference
/// order — the bound instance first (r = 0), then the others by rendezvous hash of
/// (session, instance), a fixed order per session. No session key: abstain (all 0).
/// Binds the session to the chosen instance on dispatch.
///
/// With [`Self::abstain_unbound`], a session that is not bound (its first request, or its
/// binding expired) gets no score at all: the other plugins (prefix, least-cached, predicted
/// TTFT) place it, as the layered mode's prefix layer places a new session, instead of a
/// per-session hash that ignores where its tenant's prompt is cached.
#[derive(Debug)]
pub struct SessionAffinityScorer {
    sessions: Arc<SessionTable>,
    abstain_unbound: bool,
}

impl SessionAffinityScorer {
    pub fn new(sessions: Arc<SessionTable>) -> Self {
        SessionAffinityScorer {
            sessions,
            abstain_unbound: false,
        }
    }

    /// Scores nothing for an unbound session (see the type's docs).
    pub fn abstain_unbound(mut self, abstain: bool) -> Self {
        self.abstain_unbound = abstain;
        self
    }
}

impl Scorer for SessionAffinityScorer {
    fn name(&self) -> &'static str {
        "affinity"
    }

    fn needs(&self) -> Needs {
        Needs::SESSION
    }

    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        let Some(s) = req.session else {
            return;
        };
        let bound = self.sessions.get(s, req.now_ms);
        if self.abstain_unbound && !bound.is_some_and(|b| cands.iter().any(|c| c.key == b)) {
            return;
        }
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

    fn on_complete(&self, req: &RequestView<'_>, _chosen: &Candidate, done: &Completion) {
        if let (Some(s), Outcome::Completed) = (req.session, done.outcome) {
            self.sessions.touch(s, req.now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::SessionKey;
    use crate::scorer::api::cands;

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
    fn affinity_can_abstain_for_an_unbound_session() {
        let t = Arc::new(SessionTable::default());
        let sc = SessionAffinityScorer::new(t.clone()).abstain_unbound(true);
        let cs = cands(3);
        let s = SessionKey::of("conv-new");
        let req = RequestView {
            session: Some(s),
            ..Default::default()
        };
        let mut out = vec![0.0; 3];
        sc.score(&req, &cs, &mut out);
        assert_eq!(out, vec![0.0; 3], "unbound: no score");
        // Bound to a candidate: the usual ranks, the bound one first.
        t.bind(s, cs[2].key, 0);
        sc.score(&req, &cs, &mut out);
        assert_eq!(out[2], 1.0);
        let mut rest = vec![out[0], out[1]];
        rest.sort_by(|a, b| b.partial_cmp(a).unwrap());
        assert_eq!(rest, vec![0.5, 0.25]);
        // Bound to an instance that is not a candidate (filtered out, removed): unbound.
        let mut out = vec![0.0; 2];
        sc.score(&req, &cs[..2], &mut out);
        assert_eq!(out, vec![0.0; 2]);
    }
}
