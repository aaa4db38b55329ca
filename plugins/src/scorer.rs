//! Scorers: the policy picker's plugins ([`crate::policy::WeightedSum`]).
//!
//! A scorer writes one raw score per candidate (higher is better, ≥ 0). The policy picker
//! normalises each scorer's scores to sum 1 over the candidates and adds them up with the
//! configured weights. Scorers with state learn through `on_dispatch` / `on_complete`.

use std::sync::Arc;

use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::{CostModel, Estimate};
use crate::hash::rendezvous;
use crate::layered::CostTolerance;
use crate::pipeline::{Completion, Outcome};
use crate::session::SessionTable;

/// A scoring plugin. Higher is better; scores must be finite and ≥ 0 (anything else counts
/// as 0). `out` has one slot per candidate and arrives zeroed.
pub trait Scorer: Send + Sync {
    fn name(&self) -> &'static str;
    /// The inputs it reads beyond the candidates' load.
    fn needs(&self) -> Needs {
        Needs::NONE
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]);
    /// Before any plugin scores: clear `keep[i]` to take candidate `i` out of this decision
    /// (the policy picker scores the others; a filter that would leave none is ignored).
    /// Most plugins only score.
    fn filter(&self, _req: &RequestView<'_>, _cands: &[Candidate], _keep: &mut [bool]) {}
    /// Whether [`Self::filter`] can take anything out (the policy skips the filter pass, and
    /// its allocations, when no plugin does).
    fn filters(&self) -> bool {
        false
    }
    /// The request was sent to `chosen`.
    fn on_dispatch(&self, _req: &RequestView<'_>, _chosen: &Candidate) {}
    /// The request to `chosen` finished.
    fn on_complete(&self, _req: &RequestView<'_>, _chosen: &Candidate, _done: &Completion) {}
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
/// new requests to itself once it has a queue, and the other plugins spread them. So does a
/// candidate whose KV cache has no room for the prompt next to its in-flight and recently
/// completed requests ([`Candidate::kv_fits`], when the cache size is known and some other
/// candidate has room), as in the layered prefix layer.
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
        let check_kv = cands.iter().any(|c| c.kv_fits(req.prompt_tokens));
        for (o, c) in out.iter_mut().zip(cands) {
            let r = m.ratio(c.key);
            let queued = self.max_waiting.is_some_and(|w| c.waiting > w);
            let full = check_kv && !c.kv_fits(req.prompt_tokens);
            *o = if r >= self.min_hit_ratio && !queued && !full {
                r
            } else {
                0.0
            };
        }
    }
}

/// Predicted time to first token ([`crate::cost`]): `best / est` — 1 for the candidate with
/// the lowest prediction, less for slower ones (a candidate twice as slow scores 0.5). With a
/// temperature `t` (ms): `exp(-(est - best) / t)` — the same 1 for the best, but a difference
/// counts by its size in milliseconds rather than as a ratio, so 20 ms between two idle
/// instances hardly matters while 500 ms behind a queue outweighs the other plugins.
///
/// With a room (`tolerance`, `slack_ms`): every candidate whose estimate ≤ `limit` = best ×
/// (1 + tolerance) + slack scores 1, and the shapes above apply beyond it with `limit` in place
/// of `best` (`limit / est`, or `exp(-(est - limit) / t)`). Near-best candidates then tie on
/// this plugin and the other plugins (affinity, prefix, least-cached) choose among them — "stay
/// with the cache unless it is clearly slower", as the layered mode's TTFT tolerance does.
///
/// As a filter ([`Self::with_filter`]): candidates beyond the room are removed before any
/// plugin scores, and the score has no plateau (`best / est` or the temperature shape from
/// `best`), so among the candidates left the faster still leads on this plugin. A weighted sum
/// cannot say "never one that is clearly slower"; the filter does, whatever the other
/// plugins' weights.
#[derive(Debug, Clone)]
pub struct PredictedTtftScorer {
    model: Arc<CostModel>,
    temperature_ms: Option<f64>,
    room: Option<(f64, f64)>,
    filter: bool,
}

impl PredictedTtftScorer {
    pub fn new(model: Arc<CostModel>) -> Self {
        PredictedTtftScorer {
            model,
            temperature_ms: None,
            room: None,
            filter: false,
        }
    }

    /// Removes the candidates beyond the room (no room: all but the best) before the policy
    /// sums, instead of flattening the score inside it. See the type's docs.
    pub fn with_filter(mut self, filter: bool) -> Self {
        self.filter = filter;
        self
    }

    /// The room's limit above `best`.
    fn limit(&self, best: f64) -> f64 {
        match self.room {
            Some((tolerance, slack)) => best * (1.0 + tolerance) + slack,
            None => best,
        }
    }

    /// Scores by `exp(-(est - best) / t)` (`t` in ms, > 0) instead of `best / est`.
    pub fn with_temperature_ms(mut self, t: Option<f64>) -> Self {
        self.temperature_ms = t.filter(|t| t.is_finite() && *t > 0.0);
        self
    }

    /// Scores 1 up to best × (1 + `tolerance`) + `slack_ms` (both ≥ 0; negative or NaN count
    /// as 0), the same room as the layered mode's [`CostTolerance`]. `None`: no room.
    pub fn with_room(mut self, room: Option<CostTolerance>) -> Self {
        let ok = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
        self.room = room.map(|r| (ok(r.tolerance), ok(r.slack_ms)));
        self
    }
}

impl Scorer for PredictedTtftScorer {
    fn name(&self) -> &'static str {
        "ttft"
    }
    fn needs(&self) -> Needs {
        Needs::PREFIX
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        let mut est = vec![Estimate::default(); cands.len()];
        self.model.estimate_all(req, cands, &mut est);
        let best = est.iter().map(|e| e.ms).fold(f64::INFINITY, f64::min);
        // As a filter the room has done its work; the score ranks the candidates left.
        let limit = if self.filter { best } else { self.limit(best) };
        for (o, e) in out.iter_mut().zip(&est) {
            *o = if e.ms <= limit {
                1.0
            } else {
                match self.temperature_ms {
                    Some(t) => (-(e.ms - limit) / t).exp(),
                    // e.ms > limit ≥ 0 here.
                    None => limit / e.ms,
                }
            };
        }
    }

    fn filters(&self) -> bool {
        self.filter
    }

    fn filter(&self, req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]) {
        if !self.filter {
            return;
        }
        let mut est = vec![Estimate::default(); cands.len()];
        self.model.estimate_all(req, cands, &mut est);
        let best = est
            .iter()
            .zip(keep.iter())
            .filter(|(_, k)| **k)
            .map(|(e, _)| e.ms)
            .fold(f64::INFINITY, f64::min);
        let limit = self.limit(best);
        for (k, e) in keep.iter_mut().zip(&est) {
            if e.ms > limit {
                *k = false;
            }
        }
    }
}

/// Least cached: `2^-r` where `r` is the number of candidates the gateway placed fewer blocks
/// on ([`Candidate::placed_blocks`]): the emptiest cache scores 1, equal caches
/// score the same. Where the cache sizes are known, candidates without room for the prompt
/// ([`Candidate::kv_fits`]) rank after all those with room. Policy mode's counterpart of the
/// layered mode's least-cached layer: with a small weight it decides where a prompt no
/// instance holds goes (a new tenant, a one-shot), so that cold prompts fill the emptiest
/// caches; the affinity and prefix plugins outweigh it for a prompt that is cached somewhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastCachedScorer;

impl Scorer for LeastCachedScorer {
    fn name(&self) -> &'static str {
        "least-cached"
    }
    fn needs(&self) -> Needs {
        Needs::PREFIX
    }
    fn score(&self, req: &RequestView<'_>, cands: &[Candidate], out: &mut [f64]) {
        // A cache with no room for the prompt ([`Candidate::kv_fits`]) ranks after every
        // one with room (when any has).
        let check_kv = cands.iter().any(|c| c.kv_fits(req.prompt_tokens));
        let key = |c: &Candidate| (check_kv && !c.kv_fits(req.prompt_tokens), c.placed_blocks);
        for (o, c) in out.iter_mut().zip(cands) {
            let fewer = cands.iter().filter(|d| key(d) < key(c)).count();
            *o = 0.5f64.powi(fewer.min(1000) as i32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{InstanceKey, SessionKey};
    use crate::prefix::PrefixIndex;

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

    /// 1000 tokens/s and a 10 ms step: queues of 0, 90 and 490 tokens estimate 20, 110 and
    /// 510 ms for a 10-token prompt.
    fn three_queues() -> (Arc<CostModel>, Vec<Candidate>, RequestView<'static>) {
        use crate::cost::CostConfig;
        let model = Arc::new(CostModel::new(CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 10.0,
            ..CostConfig::default()
        }));
        let mut cs = cands(3);
        cs[1].prefill_tokens = 90;
        cs[2].prefill_tokens = 490;
        let req = RequestView {
            prompt_tokens: 10,
            block_tokens: 16,
            ..Default::default()
        };
        (model, cs, req)
    }

    #[test]
    fn predicted_ttft_scores_a_ratio_or_with_a_temperature_milliseconds() {
        let (model, mut cs, req) = three_queues();
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
        let mut out = vec![0.0; 3];
        PredictedTtftScorer::new(model.clone()).score(&req, &cs, &mut out);
        assert!(close(&out, &[1.0, 20.0 / 110.0, 20.0 / 510.0]), "{out:?}");
        let warm = PredictedTtftScorer::new(model.clone()).with_temperature_ms(Some(100.0));
        warm.score(&req, &cs, &mut out);
        assert!(
            close(&out, &[1.0, (-0.9f64).exp(), (-4.9f64).exp()]),
            "{out:?}"
        );
        // The same 90 ms gap between slower candidates: a ratio barely tells them apart
        // (0.82), the temperature still does (e^-0.9 = 0.41).
        cs[0].prefill_tokens = 1000;
        cs[1].prefill_tokens = 1090;
        cs[2].prefill_tokens = 2000;
        PredictedTtftScorer::new(model.clone()).score(&req, &cs, &mut out);
        assert!((out[1] - 1020.0 / 1110.0).abs() < 1e-9);
        warm.score(&req, &cs, &mut out);
        assert!((out[1] - (-0.9f64).exp()).abs() < 1e-9);
        // A temperature of 0 or NaN is ignored (the ratio).
        let cold = PredictedTtftScorer::new(model).with_temperature_ms(Some(0.0));
        cold.score(&req, &cs, &mut out);
        assert!((out[1] - 1020.0 / 1110.0).abs() < 1e-9);
    }

    #[test]
    fn predicted_ttft_with_a_room_ties_the_near_best_and_decays_beyond() {
        // Estimates 20, 110 and 510 ms.
        let (model, cs, req) = three_queues();
        let mut out = vec![0.0; 3];
        // Limit 20 × 1.5 + 100 = 130 ms: the first two tie, the third scores 130 / 510.
        let roomy = PredictedTtftScorer::new(model.clone()).with_room(Some(CostTolerance {
            tolerance: 0.5,
            slack_ms: 100.0,
        }));
        roomy.score(&req, &cs, &mut out);
        assert_eq!(&out[..2], &[1.0, 1.0]);
        assert!((out[2] - 130.0 / 510.0).abs() < 1e-9, "{out:?}");
        // With a temperature beyond the limit: exp(-(510 - 130) / 100).
        let warm = roomy.with_temperature_ms(Some(100.0));
        warm.score(&req, &cs, &mut out);
        assert_eq!(&out[..2], &[1.0, 1.0]);
        assert!((out[2] - (-3.8f64).exp()).abs() < 1e-9, "{out:?}");
        // No room (negative counts as 0): the plain ratio again.
        let none = PredictedTtftScorer::new(model).with_room(Some(CostTolerance {
            tolerance: -1.0,
            slack_ms: f64::NAN,
        }));
        none.score(&req, &cs, &mut out);
        assert!((out[1] - 20.0 / 110.0).abs() < 1e-9, "{out:?}");
    }

    #[test]
    fn predicted_ttft_as_a_filter_drops_beyond_the_room_and_ranks_from_the_best() {
        // Estimates 20, 110 and 510 ms; room 20 × 1.5 + 100 = 130 ms.
        let (model, cs, req) = three_queues();
        let room = Some(CostTolerance {
            tolerance: 0.5,
            slack_ms: 100.0,
        });
        let gate = PredictedTtftScorer::new(model.clone())
            .with_room(room)
            .with_filter(true);
        let mut keep = vec![true; 3];
        gate.filter(&req, &cs, &mut keep);
        assert_eq!(keep, vec![true, true, false]);
        // No plateau: among those left the faster still leads (20 / 110).
        let mut out = vec![0.0; 2];
        gate.score(&req, &cs[..2], &mut out);
        assert!((out[0] - 1.0).abs() < 1e-9 && (out[1] - 20.0 / 110.0).abs() < 1e-9);
        // The best is the best of those an earlier filter kept: without candidate 0 the
        // limit is 110 × 1.5 + 100 = 265 ms, and 510 ms is still out.
        let mut keep = vec![false, true, true];
        gate.filter(&req, &cs, &mut keep);
        assert_eq!(keep, vec![false, true, false]);
        // No room: only the best stays.
        let strict = PredictedTtftScorer::new(model.clone()).with_filter(true);
        let mut keep = vec![true; 3];
        strict.filter(&req, &cs, &mut keep);
        assert_eq!(keep, vec![true, false, false]);
        // Not a filter: keeps everything (the room flattens the score instead).
        let soft = PredictedTtftScorer::new(model).with_room(room);
        let mut keep = vec![true; 3];
        soft.filter(&req, &cs, &mut keep);
        assert_eq!(keep, vec![true; 3]);
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

    #[test]
    fn a_full_kv_cache_ranks_last_for_least_cached_and_scores_no_prefix() {
        let mut cs = cands(3);
        for (c, b) in cs.iter_mut().zip([0, 10, 20]) {
            c.placed_blocks = b;
            c.cache_tokens = 1000;
        }
        // 0 is the emptiest but its in-flight and recent requests fill it.
        cs[0].inflight_tokens = 700;
        cs[0].recent_tokens = 200;
        let r = RequestView {
            prompt_tokens: 200,
            ..Default::default()
        };
        let mut out = vec![0.0; 3];
        LeastCachedScorer.score(&r, &cs, &mut out);
        assert_eq!(out, vec![0.25, 1.0, 0.5]);
        // Every cache full: by blocks alone again.
        for c in &mut cs {
            c.inflight_tokens = 900;
        }
        LeastCachedScorer.score(&r, &cs, &mut out);
        assert_eq!(out, vec![1.0, 0.5, 0.25]);
        // The prefix plugin: 0 holds the whole prompt, 1 half; 0 is full.
        let idx = PrefixIndex::default();
        let prompt = [1, 2, 3, 4];
        idx.insert(&prompt, cs[0].key, 0);
        idx.insert(&prompt[..2], cs[1].key, 0);
        let m = idx.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prompt_tokens: 200,
            prefix: Some(&m),
            ..Default::default()
        };
        cs[1].inflight_tokens = 0;
        PrefixScorer::default().score(&r, &cs, &mut out);
        assert_eq!(out, vec![0.0, 0.5, 0.0]);
        // No cache has room: the match counts.
        cs[1].inflight_tokens = 900;
        PrefixScorer::default().score(&r, &cs, &mut out);
        assert_eq!(out, vec![1.0, 0.5, 0.0]);
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
