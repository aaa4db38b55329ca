//! Layer 1: session affinity ([`AffinityStage`]).

use std::borrow::Cow;
use std::sync::Arc;

use super::adaptive::{adaptive_verdict, Adaptive, Others};
use super::ctx::{CostTolerance, Hit, LayerCtx, Stage};
use crate::candidate::{Candidate, Needs, RequestView};
use crate::decision::{AffinityOutcome, Layer};
use crate::pipeline::{Completion, Outcome};
use crate::session::SessionTable;

/// Strict or soft session affinity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AffinityMode {
    #[default]
    Soft,
    Strict,
}

impl AffinityMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityMode::Soft => "soft",
            AffinityMode::Strict => "strict",
        }
    }
}

/// When soft affinity leaves the bound instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Escape {
    /// Its load (the balancing figure) > average × this (`soft_max_load_ratio`, e.g. 1.5).
    Load(f64),
    /// Its predicted TTFT is not within this of the best candidate's.
    Cost(CostTolerance),
    /// Waiting for it costs more than moving: the prefix layer's stay-or-move comparison
    /// ([`Adaptive`]) applied to the bound instance against every other candidate — its
    /// predicted TTFT against the cheapest other's plus the placement term of what it holds of
    /// the prompt and that one lacks (the session's history, recomputed and written over
    /// someone else's prefix there), within the safety caps — and it is not within the TTFT
    /// tolerance of the best either (the binding says the history is there even when the
    /// index has forgotten it; within the tolerance it stays, caps or not, as under
    /// [`Escape::Cost`]). The default.
    Adaptive(Adaptive, CostTolerance),
}

/// Layer 1: session affinity. See the module documentation.
#[derive(Debug)]
pub struct AffinityStage {
    pub mode: AffinityMode,
    /// Soft mode's escape rule.
    pub escape: Escape,
    sessions: Arc<SessionTable>,
}

impl AffinityStage {
    pub fn new(mode: AffinityMode, escape: Escape, sessions: Arc<SessionTable>) -> Self {
        AffinityStage {
            mode,
            escape,
            sessions,
        }
    }

    pub fn sessions(&self) -> &Arc<SessionTable> {
        &self.sessions
    }
}

impl Stage for AffinityStage {
    fn name(&self) -> &'static str {
        "affinity"
    }

    fn needs(&self) -> Needs {
        Needs::SESSION
    }

    fn uses_cost(&self) -> bool {
        self.mode == AffinityMode::Soft
            && matches!(self.escape, Escape::Cost(_) | Escape::Adaptive(..))
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        let Some(s) = cx.req.session else {
            cx.affinity = AffinityOutcome::NoSession;
            return None;
        };
        let Some(bound) = self.sessions.get(s, cx.req.now_ms) else {
            cx.affinity = AffinityOutcome::Unbound;
            return None;
        };
        let Some(p) = cx.cands.iter().position(|c| c.key == bound) else {
            cx.affinity = AffinityOutcome::Rebind;
            cx.headline = Some(Cow::Borrowed(AffinityOutcome::Rebind.as_str()));
            return None;
        };
        let ok = match self.mode {
            AffinityMode::Strict => true,
            AffinityMode::Soft => match self.escape {
                Escape::Load(ratio) => {
                    let limit = cx.avg_load * ratio;
                    if cx.req.explain {
                        cx.notes
                            .push(format!("soft: bound load <= avg*ratio={limit:.1}"));
                    }
                    cx.rows[p].load as f64 <= limit
                }
                Escape::Cost(t) => {
                    if cx.req.explain {
                        cx.notes.push(format!("soft: bound {}", within(cx, &t)));
                    }
                    cx.cost_eligible(p, &t)
                }
                Escape::Adaptive(a, t) => {
                    // Within the TTFT tolerance it stays whatever else holds (the previous
                    // rule, a floor: the binding is evidence of the session's history there
                    // even where the index has forgotten it — a cache-size bound — and the
                    // comparison would then weigh the queues alone).
                    let near = cx.cost_eligible(p, &t);
                    if near {
                        if cx.req.explain {
                            cx.notes
                                .push(format!("soft: bound stays ({})", within(cx, &t)));
                        }
                        true
                    } else if a.over_caps(cx.rows[p].load as f64, cx.avg_load, cx.cands[p].waiting)
                    {
                        if cx.req.explain {
                            cx.notes.push(format!(
                                "soft: bound moves (load {} waiting {} outside {})",
                                cx.rows[p].load,
                                cx.cands[p].waiting,
                                a.describe_caps(cx.avg_load)
                            ));
                        }
                        false
                    } else {
                        let v = adaptive_verdict(cx.req, cx.cands, cx.est, &a, p, Others::All);
                        if cx.req.explain {
                            let verb = if v.stays() { "stays" } else { "moves" };
                            cx.notes.push(match v.to {
                                Some((j, est, copy)) => format!(
                                    "soft: bound {verb} (wait {:.0}ms vs #{} {est:.0}+copy {copy:.0}ms)",
                                    v.stay_ms, cx.cands[j].idx
                                ),
                                None => "soft: bound stays (no other candidate)".to_string(),
                            });
                        }
                        v.stays()
                    }
                }
            },
        };
        if ok {
            cx.affinity = AffinityOutcome::Hit;
            Some(Hit {
                pos: p,
                layer: Layer::Affinity,
                reason: Cow::Borrowed("affinity"),
            })
        } else {
            cx.affinity = AffinityOutcome::Escape;
            cx.headline = Some(Cow::Borrowed(AffinityOutcome::Escape.as_str()));
            None
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

/// `est <= best*(1+0.25)+25ms=1305ms`: the TTFT tolerance's room, for the explanation.
fn within(cx: &LayerCtx<'_, '_>, t: &CostTolerance) -> String {
    format!(
        "est <= best*(1+{})+{}ms={:.0}ms",
        t.tolerance,
        t.slack_ms,
        cx.min_est * (1.0 + t.tolerance) + t.slack_ms
    )
}
