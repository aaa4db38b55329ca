//! Layer 3: least cached ([`LeastCachedStage`]).

use std::borrow::Cow;

use super::ctx::{CostTolerance, Hit, LayerCtx, Stage};
use crate::candidate::Needs;
use crate::cost::Estimate;
use crate::decision::Layer;

/// Layer 3 (optional): where a request goes when no instance is preferred for its session or
/// its cache — a new tenant's first request, a one-shot with an unseen prompt, a session whose
/// cached instance was too busy. Each candidate's cost is its predicted TTFT plus what the
/// prompt's prefill costs the requests arriving behind it there
/// ([`Estimate::harm_ms`](crate::cost::Estimate::harm_ms): the instance's arrival rate × the
/// prefill × the backlog ahead and half the prefill, for as long as its busy period lasts).
/// Eligible: a cost within the tolerance's room (best TTFT × `tolerance` + `slack_ms`) of the
/// least cost, and a harm within `slack_ms` of the least harm among those. Among them, the
/// one the gateway has placed the fewest blocks on
/// ([`Candidate::placed_blocks`](crate::candidate::Candidate::placed_blocks): what the prefix
/// index believes it holds, plus what a cache-size bound made the index forget — where the
/// bound applies, every busy instance's held blocks sit at its cache size); ties: lower load,
/// then a rotation. Whatever lands there will be cached there, so cold prompts fill the
/// emptiest caches first and the fleet's caches hold more distinct prefixes between them,
/// rather than whichever instance was momentarily least loaded taking a hot new tenant next
/// to its other hot ones. A short prompt's harm is a few milliseconds anywhere and the placed
/// blocks decide; a long cold prompt goes where the fewest live sessions will come back while
/// it waits and prefills; and in a saturated fleet a cold prompt does not go to a hot
/// tenant's home just because its cheap warm turns leave a short queue this instant.
/// Reason `least-cached`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastCachedStage(pub CostTolerance);

impl Stage for LeastCachedStage {
    fn name(&self) -> &'static str {
        "least-cached"
    }

    fn needs(&self) -> Needs {
        Needs::PREFIX
    }

    fn uses_cost(&self) -> bool {
        true
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        let n = cx.cands.len();
        let t = self.0;
        // What its prefill costs the requests arriving behind it there.
        let harm = |i: usize| cx.est.get(i).map_or(0.0, |e| e.harm_ms());
        // Eligible: its own predicted TTFT plus that cost within the usual room (the best
        // TTFT × tolerance + slack) of the least such total. A short queue on an instance
        // whose live sessions keep coming back is no saving when they all wait behind the
        // prompt; and the room stays the request's own, however large the harms are. The
        // followers' prefill (the next turns and sessions that will share what it places,
        // at each instance's own rate) makes a slow engine dearer on a mixed fleet; on equal
        // engines it is the same everywhere and decides nothing.
        let total = |i: usize| cx.est.get(i).map_or(0.0, Estimate::cold_cost_ms);
        let least_total = (0..n).map(total).fold(f64::INFINITY, f64::min);
        let limit = least_total + cx.min_est * t.tolerance + t.slack_ms;
        let near = |i: usize| cx.est.is_empty() || total(i) <= limit;
        // The least harm among those, and the room above it within which placed blocks
        // decide.
        // (No estimates: no cap, the least over nothing is infinite.)
        let harm_cap = crate::cost::harm_cap(cx.est, near, t.slack_ms);
        let cuts = cx.req.explain && (0..n).any(|i| near(i) && harm(i) > harm_cap);
        let note = cuts.then(|| {
            format!(
                "least-cached: and if harm <= least+{}ms={harm_cap:.0}ms",
                t.slack_ms
            )
        });
        let start = (cx.req.turn % n as u64) as usize;
        if cx.req.explain {
            cx.notes.push(format!(
                "least-cached: eligible if est + harm + follow <= least + best est*{}+{}ms={limit:.0}ms (harm: arrivals x own x (max(queue, fleet mean queue) + own/2) x (1 + min(avg_wait, busy/(1 - busy))); follow: followers x their new tokens / rate), fewest cached blocks wins (tie: lower load)",
                t.tolerance, t.slack_ms,
            ));
        }
        let mut best: Option<usize> = None;
        for step in 0..n {
            let i = (start + step) % n;
            if !near(i) || harm(i) > harm_cap {
                continue;
            }
            let key = |j: usize| (cx.cands[j].placed_blocks, cx.rows[j].load);
            if best.is_none_or(|b| key(i) < key(b)) {
                best = Some(i);
            }
        }
        cx.notes.extend(note);
        best.map(|pos| Hit {
            pos,
            layer: Layer::Balance,
            reason: Cow::Borrowed("least-cached"),
        })
    }
}
