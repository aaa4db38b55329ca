//! Layer 2: the prefix cache ([`PrefixStage`]).

use std::borrow::Cow;
use std::fmt::Write as _;

use super::adaptive::{adaptive_verdict, Adaptive, Others, COST_LOAD_CAP, COST_WAITING_CAP};
use super::ctx::{CostTolerance, Hit, LayerCtx, Stage};
use crate::candidate::Needs;
use crate::decision::Layer;

/// The reason of a request whose prompt was cached on an instance the adaptive comparison
/// moved it away from ([`Adaptive`]); the explanation names the layer that then chose.
pub const PREFIX_SPILL: &str = "prefix-spill";

/// Which candidates the prefix layer may prefer for their cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Eligibility {
    /// load ≤ average × (1 + `load_tolerance`) and waiting ≤ `waiting_threshold` (the fixed
    /// ratios of the original layered mode; defaults 0.3 and 2).
    Load {
        load_tolerance: f64,
        waiting_threshold: u64,
    },
    /// Predicted TTFT within a tolerance of the best candidate's (and under the safety caps
    /// [`COST_LOAD_CAP`], [`COST_WAITING_CAP`]).
    Cost(CostTolerance),
    /// Stay or move, by comparing costs ([`Adaptive`]): the default.
    Adaptive(Adaptive),
}

/// Layer 2 settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixLayerConfig {
    /// Below this hit ratio it is a miss. Default 0.50 with load eligibility, 0 with cost.
    pub min_hit_ratio: f64,
    pub eligibility: Eligibility,
}

impl Default for PrefixLayerConfig {
    /// The original fixed ratios: min hit 0.5, load tolerance 0.3, waiting threshold 2.
    fn default() -> Self {
        PrefixLayerConfig {
            min_hit_ratio: 0.50,
            eligibility: Eligibility::Load {
                load_tolerance: 0.3,
                waiting_threshold: 2,
            },
        }
    }
}

/// Layer 2: the prefix cache. See the module documentation.
#[derive(Clone, Debug, Default)]
pub struct PrefixStage(pub PrefixLayerConfig);

impl Stage for PrefixStage {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn needs(&self) -> Needs {
        Needs::PREFIX
    }

    fn uses_cost(&self) -> bool {
        matches!(
            self.0.eligibility,
            Eligibility::Cost(_) | Eligibility::Adaptive(_)
        )
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        let p = &self.0;
        let n = cx.cands.len();
        let prompt_blocks = cx.req.prompt_blocks();
        // The longest-match holder the adaptive comparison moved away from (for the reason).
        let mut spilled: Option<usize> = None;
        match p.eligibility {
            Eligibility::Adaptive(a) => spilled = adaptive_eligibility(p, &a, cx),
            Eligibility::Load {
                load_tolerance,
                waiting_threshold,
            } => {
                let limit = cx.avg_load * (1.0 + load_tolerance);
                if cx.req.explain {
                    let mut s = String::new();
                    let _ = write!(
                        s,
                        "prefix: eligible if load <= avg*(1+tol)={limit:.1} && waiting <= {waiting_threshold}, hit if matched/{prompt_blocks} >= {:.2}, longest match wins (tie: lower load)",
                        p.min_hit_ratio
                    );
                    cx.notes.push(s);
                }
                for (r, c) in cx.rows.iter_mut().zip(cx.cands) {
                    if !(r.load as f64 <= limit && c.waiting <= waiting_threshold) {
                        r.ineligible = true;
                    }
                }
            }
            Eligibility::Cost(t) => {
                // The predicted TTFT sees queued prefill work, not what a hot instance's
                // running batch does to its KV cache: a cap on in-flight load keeps one
                // instance from taking so much that it evicts the prefixes it was chosen for.
                let limit = cx.avg_load * (1.0 + COST_LOAD_CAP);
                if cx.req.explain {
                    cx.notes.push(format!(
                        "prefix: eligible if est <= best*(1+{})+{}ms={:.0}ms && load <= avg*(1+{COST_LOAD_CAP})={limit:.1} && waiting <= {COST_WAITING_CAP}, hit if matched/{prompt_blocks} >= {:.2}, longest match wins (tie: lower load)",
                        t.tolerance,
                        t.slack_ms,
                        cx.min_est * (1.0 + t.tolerance) + t.slack_ms,
                        p.min_hit_ratio
                    ));
                }
                for i in 0..n {
                    if !cx.cost_eligible(i, &t)
                        || cx.rows[i].load as f64 > limit
                        || cx.cands[i].waiting > COST_WAITING_CAP
                    {
                        cx.rows[i].ineligible = true;
                    }
                }
            }
        }
        if prompt_blocks == 0 {
            return None;
        }
        let hit = longest_eligible(cx).and_then(|b| {
            let m = cx.rows[b].matched;
            let ratio = f64::from(m) / f64::from(prompt_blocks);
            (m > 0 && ratio >= p.min_hit_ratio).then(|| Hit {
                pos: b,
                layer: Layer::Prefix,
                reason: Cow::Owned(format!("prefix({ratio:.2})")),
            })
        });
        if hit.is_none() && cx.headline.is_none() {
            let spill = |s: usize| {
                f64::from(cx.rows[s].matched) / f64::from(prompt_blocks) >= p.min_hit_ratio
            };
            if spilled.is_some_and(spill) {
                // The prompt is cached, but waiting for its holder costs more than
                // recomputing it elsewhere plus the copy's placement: the layers below choose.
                cx.headline = Some(Cow::Borrowed(PREFIX_SPILL));
            }
        }
        hit
    }
}

/// The adaptive rule's eligibility ([`Adaptive`]): marks the holders over the rails or whose
/// stay-or-move comparison says move, and returns the longest-match holder it moved away from
/// (the lowest load among equals; for the `prefix-spill` reason).
fn adaptive_eligibility(
    p: &PrefixLayerConfig,
    a: &Adaptive,
    cx: &mut LayerCtx<'_, '_>,
) -> Option<usize> {
    let n = cx.cands.len();
    let prompt_blocks = cx.req.prompt_blocks();
    let mut spilled: Option<usize> = None;
    if cx.req.explain {
        cx.notes.push(format!(
                "prefix: eligible if est <= min over those holding less of (est + copy*{}) && {}, hit if matched/{prompt_blocks} >= {:.2}, longest match wins (tie: lower load)",
                a.placement, a.describe_caps(cx.avg_load), p.min_hit_ratio
            ));
    }
    let best_m = cx.rows.iter().map(|r| r.matched).max().unwrap_or(0);
    let mut said = String::new();
    for i in 0..n {
        if a.over_caps(cx.rows[i].load as f64, cx.avg_load, cx.cands[i].waiting) {
            cx.rows[i].ineligible = true;
            continue;
        }
        if cx.rows[i].matched == 0 {
            continue;
        }
        let v = adaptive_verdict(cx.req, cx.cands, cx.est, a, i, Others::HoldingLess);
        if !v.stays() {
            cx.rows[i].ineligible = true;
            if cx.rows[i].matched == best_m
                && spilled.is_none_or(|s| cx.rows[i].load < cx.rows[s].load)
            {
                spilled = Some(i);
            }
        }
        if cx.req.explain {
            let (verb, term) = if v.stays() {
                ("stays", "wait")
            } else {
                ("moves", "recompute+placement")
            };
            match v.to {
                Some((j, est, copy)) => {
                    let _ = write!(
                        said,
                        " #{}:{verb}({term}: {:.0}ms vs #{} {est:.0}+copy {copy:.0}ms)",
                        cx.cands[i].idx, v.stay_ms, cx.cands[j].idx
                    );
                }
                None => {
                    let _ = write!(said, " #{}:stays(nowhere holds less)", cx.cands[i].idx);
                }
            }
        }
    }
    if !said.is_empty() {
        cx.notes.push(format!("prefix: holders:{said}"));
    }
    spilled
}

/// The eligible row with the longest match (ties: the lower load, then the first from a
/// start that turns with the session's turn).
fn longest_eligible(cx: &LayerCtx<'_, '_>) -> Option<usize> {
    let n = cx.cands.len();
    let start = (cx.req.turn % n as u64) as usize;
    let mut best: Option<usize> = None;
    for step in 0..n {
        let i = (start + step) % n;
        let r = &cx.rows[i];
        if r.ineligible {
            continue;
        }
        let better = match best {
            None => true,
            Some(b) => {
                let o = &cx.rows[b];
                (r.matched, std::cmp::Reverse(r.load)) > (o.matched, std::cmp::Reverse(o.load))
            }
        };
        if better {
            best = Some(i);
        }
    }
    best
}
