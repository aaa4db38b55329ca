//! The stay-or-move comparison ([`Adaptive`]) the prefix layer and soft affinity use by
//! default.

use crate::candidate::{Candidate, RequestView};
use crate::cost::Estimate;

/// With cost eligibility, the prefix layer also skips an instance that has requests waiting
/// for their first token and an in-flight load above the average × (1 + this) ...
pub const COST_LOAD_CAP: f64 = 3.0;
/// ... or that has more requests waiting for their first token than this.
pub const COST_WAITING_CAP: u64 = 16;

/// The default prefix eligibility (and soft affinity's default escape): a candidate holding
/// `m` blocks of the prompt is kept while waiting there costs no more than moving, i.e. while
///
/// ```text
///   est(h) + q(h)  <=  min over j of  est(j) + q(j) + placement × copy(j)
/// ```
///
/// (`j` ranges over those holding less for the prefix layer, over every other candidate for
/// a session's instance.)
///
/// * `est` — the predicted TTFT ([`crate::cost::CostModel`]): the queued prefill ahead of the
///   request (ours and, with engine metrics, others') at the instance's learned rate, plus
///   its own uncached part there, plus a decode step. On the holder the own part is small;
///   on `j` it is the recomputation of whatever `j` lacks.
/// * `q` — the queueing term ([`Estimate::queue_cost_ms`]): the request's own prefill × ρ /
///   (1 − ρ), ρ the instance's utilization (the share of recent decisions that found
///   requests waiting for their first token there). What the work a request adds costs
///   those arriving behind it: ~0 on an idle or lightly used instance, up to 19 × its own
///   prefill on a saturated one. So a saturated holder sheds work to an idle engine (one
///   that joined or came back) before its queue has grown to a whole recomputation, while
///   in a fleet where every engine is saturated a recomputation anywhere costs 19 times
///   over and prompts stay with their holders.
/// * `copy(j)` — the placement term: the tokens the holder has and `j` would have to write,
///   at `j`'s rate. A copy elsewhere evicts as much of what `j` caches (someone else's prefix,
///   which its next turns recompute), so the move is charged for it once more, × `placement`.
///   Charged even where `j`'s cache is known to have room (what a copy fills is evicted
///   later; matrix run 21).
///
/// So the holder of a long prompt is waited for longer than the holder of a short one (moving
/// a long prompt recomputes and evicts more), and a hot tenant's prefix gets a second home
/// when its first has a queue longer than a recomputation plus a copy elsewhere — and not
/// before; once two instances hold it they share it (equal matches go to the lower load).
/// Nothing is a fixed count of requests: the figures are the fleet's own (learned rates,
/// queued tokens). The caps `load_tolerance` / `waiting_cap` are safety rails only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adaptive {
    /// Weight of the placement term (1 = a copy evicts as much as it writes, recomputed once).
    pub placement: f64,
    /// Never preferred when its load > average × (1 + this) while requests wait for their
    /// first token there ([`Adaptive::over_caps`]).
    pub load_tolerance: f64,
    /// Never preferred with more requests than this waiting for their first token.
    pub waiting_cap: u64,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            placement: 1.0,
            load_tolerance: COST_LOAD_CAP,
            waiting_cap: COST_WAITING_CAP,
        }
    }
}

impl Adaptive {
    /// The safety rails: more than `waiting_cap` requests waiting for their first token, or
    /// an in-flight `load` above `avg` × (1 + `load_tolerance`) *with* a queue. Load that is
    /// only decoding does not delay a new prefill beyond the decode step the estimate already
    /// prices: a hot tenant's home in a fleet of mostly idle engines carries many times the
    /// average in decode alone, and a load cap there moved sessions off their whole cached
    /// history (`few-1k-agents-nohdr-all-high-8eq`: predicted 163 vs 1,011 ms, answered in
    /// 956 ms where staying took ~200).
    pub fn over_caps(&self, load: f64, avg: f64, waiting: u64) -> bool {
        waiting > self.waiting_cap || (waiting > 0 && load > avg * (1.0 + self.load_tolerance))
    }

    /// The rails in a reason: `load <= avg*(1+3)=1200.0 (with a queue) && waiting <= 16`.
    pub fn describe_caps(&self, avg: f64) -> String {
        format!(
            "load <= avg*(1+{})={:.1} (with a queue) && waiting <= {}",
            self.load_tolerance,
            avg * (1.0 + self.load_tolerance),
            self.waiting_cap
        )
    }
}

/// What the adaptive comparison said about one holder ([`Adaptive`]).
#[derive(Clone, Copy, Debug)]
pub struct Verdict {
    /// The holder's predicted TTFT plus its queueing term, ms.
    pub stay_ms: f64,
    /// The cheapest move: its candidate, its predicted TTFT plus queueing term, and its
    /// placement term, ms.
    pub to: Option<(usize, f64, f64)>,
}

impl Verdict {
    pub fn stays(&self) -> bool {
        self.to
            .is_none_or(|(_, est, copy)| self.stay_ms <= est + copy)
    }
}

/// Which candidates a stay-or-move comparison weighs the holder against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Others {
    /// Those holding fewer of the prompt's blocks (the prefix layer: the longest match
    /// among equals is its own choice).
    HoldingLess,
    /// Every other candidate (soft affinity: the session's instance against anywhere else).
    All,
}

/// The adaptive comparison for candidate `i` (which holds `req.matched(&cands[i])` blocks),
/// with `est` the predicted TTFT per candidate.
pub fn adaptive_verdict(
    req: &RequestView<'_>,
    cands: &[Candidate],
    est: &[Estimate],
    a: &Adaptive,
    i: usize,
    others: Others,
) -> Verdict {
    let m = req.matched(&cands[i]);
    let bt = req.block_tokens.max(1) as f64;
    let mut to: Option<(usize, f64, f64)> = None;
    for (j, c) in cands.iter().enumerate() {
        let mj = req.matched(c);
        if j == i || (others == Others::HoldingLess && mj >= m) {
            continue;
        }
        let Some(e) = est.get(j) else { continue };
        // Charged whether or not the cache is known to have room for the copy: the copies
        // made while there is room (every cache is empty at a fleet's start) fill it, and are
        // evicted later. Counting them free cost 1-8 cached points in the matrix, first for
        // empty caches only (not kept), then as the rule for known cache sizes (run 21).
        let copy =
            a.placement.max(0.0) * f64::from(m.saturating_sub(mj)) * bt * 1000.0 / e.tps.max(1.0);
        let ms = e.ms + e.queue_cost_ms();
        if to.is_none_or(|(_, est, cp)| ms + copy < est + cp) {
            to = Some((j, ms, copy));
        }
    }
    Verdict {
        stay_ms: est.get(i).map_or(0.0, |e| e.ms + e.queue_cost_ms()),
        to,
    }
}
