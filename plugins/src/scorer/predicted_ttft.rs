//! `kind: predicted-ttft`: the predicted time to first token ([`crate::cost`]).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::api::{BuildCtx, Plugin, PluginParams, Scorer};
use crate::candidate::{Candidate, Needs, RequestView};
use crate::cost::{harm_cap, CostModel, Estimate};
use crate::layered::{adaptive_verdict, Adaptive, CostTolerance, Others};

/// `best / est`: the predicted time to first token relative to the best candidate's; with
/// `temperature`, `exp(-(est - best) / temperature)` instead. With `tolerance` / `slack`,
/// every candidate within best × (1 + tolerance) + slack scores 1 and that limit takes
/// the place of `best` beyond it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PredictedTtftParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// How many milliseconds slower make a candidate e (2.718…) times less attractive:
    /// small differences barely count, large ones dominate. Unset: `best / est`.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub temperature: Option<Duration>,
    /// Room above the best estimate in which candidates tie (score 1), as a share of it
    /// (e.g. 0.5). Unset (and no `slack`): no room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance: Option<f64>,
    /// Absolute room added to `tolerance` (e.g. 50ms).
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub slack: Option<Duration>,
    /// `true`: candidates beyond the room are removed before any plugin scores (the other
    /// plugins choose among the rest, whatever their weights), and the score ranks those
    /// left from the best (no plateau). Without `tolerance` / `slack` only the best stays.
    /// For a prompt no candidate holds any of, the room is over the estimate plus the
    /// prefill's harm to those arriving behind it, above the least such total, and of those
    /// only the ones whose harm is within `slack` of the least harm stay (the least-cached
    /// layer's rule, [`harm_cap`]).
    #[serde(default)]
    pub filter: bool,
    /// With `filter`: a candidate beyond the room that holds more of the prompt than another
    /// is kept while waiting for it costs no more than moving — the predicted TTFT elsewhere
    /// plus a copy of what it holds (the layered scheduler's default prefix rule, under the
    /// same safety caps: load ≤ 4 × the average, ≤ 16 waiting). Without it, the room alone
    /// decides and a hot prefix's holder loses its requests as soon as it is slower than the
    /// room, however long the prompt it would recompute elsewhere.
    #[serde(default)]
    pub stay_or_move: bool,
}

impl PluginParams for PredictedTtftParams {
    fn weight(&self) -> Option<f64> {
        self.weight
    }

    fn check(&self, p: &str, errs: &mut Vec<String>) {
        if self.temperature.is_some_and(|t| t.is_zero()) {
            errs.push(format!(
                "{p}.temperature: must be longer than 0 (e.g. 100ms)"
            ));
        }
        if self.stay_or_move && !self.filter {
            errs.push(format!(
                "{p}.stay_or_move: only with `filter: true` (it decides which slow holders the filter keeps)"
            ));
        }
        if let Some(t) = self.tolerance {
            if !(t.is_finite() && t >= 0.0) {
                errs.push(format!("{p}.tolerance: must be a number >= 0 (e.g. 0.5)"));
            }
        }
    }

    fn build(&self, ctx: &mut BuildCtx<'_>) -> Plugin {
        let room = (self.tolerance.is_some() || self.slack.is_some()).then(|| CostTolerance {
            tolerance: self.tolerance.unwrap_or(0.0),
            slack_ms: self.slack.unwrap_or(Duration::ZERO).as_secs_f64() * 1000.0,
        });
        Plugin::Scorer(Arc::new(
            PredictedTtftScorer::new(ctx.cost.clone())
                .with_temperature_ms(self.temperature.map(|t| t.as_secs_f64() * 1000.0))
                .with_room(room)
                .with_filter(self.filter)
                .with_stay_or_move(self.stay_or_move.then(Adaptive::default)),
        ))
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
    stay_or_move: Option<Adaptive>,
}

impl PredictedTtftScorer {
    pub fn new(model: Arc<CostModel>) -> Self {
        PredictedTtftScorer {
            model,
            temperature_ms: None,
            room: None,
            filter: false,
            stay_or_move: None,
        }
    }

    /// As a filter, also keeps a holder of the prompt beyond the room while the comparison
    /// `a` says staying costs no more than moving ([`Adaptive`]). See
    /// [`PredictedTtftParams::stay_or_move`].
    pub fn with_stay_or_move(mut self, a: Option<Adaptive>) -> Self {
        self.stay_or_move = a;
        self
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

/// A prompt no candidate holds any of (placed for the first time): its cost counts what its
/// prefill does to the requests behind it ([`Estimate::cold_cost_ms`]).
fn is_cold(req: &RequestView<'_>, cands: &[Candidate]) -> bool {
    cands.iter().all(|c| req.matched(c) == 0)
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
        // A prompt no candidate holds any of (a cold one, placed for the first time) also
        // counts what its prefill costs the requests arriving behind it there
        // ([`Estimate::harm_ms`]), as the layered mode's least-cached layer does.
        let cold = is_cold(req, cands);
        if cold {
            self.model.arrivals(cands, req.now_ms, &mut est);
        }
        let cost = |e: &Estimate| if cold { e.cold_cost_ms() } else { e.ms };
        let best = est.iter().map(cost).fold(f64::INFINITY, f64::min);
        // As a filter the room has done its work; the score ranks the candidates left.
        let limit = if self.filter { best } else { self.limit(best) };
        for (o, e) in out.iter_mut().zip(&est) {
            let ms = cost(e);
            *o = if ms <= limit {
                1.0
            } else {
                match self.temperature_ms {
                    Some(t) => (-(ms - limit) / t).exp(),
                    // ms > limit ≥ 0 here.
                    None => limit / ms,
                }
            };
        }
    }

    fn filters(&self) -> bool {
        self.filter
    }

    fn estimates(&self, req: &RequestView<'_>, cands: &[Candidate]) -> Option<(bool, Vec<Estimate>)> {
        let mut est = vec![Estimate::default(); cands.len()];
        self.model.estimate_all(req, cands, &mut est);
        let cold = is_cold(req, cands);
        // The utilization as last sampled (reading it does not sample it again).
        self.model.arrivals(cands, req.now_ms, &mut est);
        Some((cold, est))
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
        if self.stay_or_move.is_some() {
            self.model.utilization(cands, req.now_ms, &mut est);
        }
        // A cold prompt (no candidate holds any of it) is kept by its predicted TTFT plus its
        // prefill's harm to the requests arriving behind it, within the room above the least
        // such total, as the score ranks it and as the layered mode's least-cached layer
        // keeps it. (On TTFT alone the room kept a hot tenant's busy home, whose cheap warm
        // turns leave a short queue this instant, and the harm was one plugin's 0.25 among
        // the others: matrix run 11, seeds 1–3, the policy mode's p50 in
        // `many-12k-people-half-high-8eq` 1.25 → 1.03 × smg's and in the overloaded cells
        // 1.16 → 0.99 and 1.79 → 0.99.)
        let cold = is_cold(req, cands);
        if cold && self.stay_or_move.is_none() {
            self.model.arrivals(cands, req.now_ms, &mut est);
        }
        let cost = |e: &Estimate| if cold { e.cold_cost_ms() } else { e.ms };
        let limit = if cold {
            let least = est
                .iter()
                .zip(keep.iter())
                .filter(|(_, k)| **k)
                .map(|(e, _)| cost(e))
                .fold(f64::INFINITY, f64::min);
            least + self.limit(best) - best
        } else {
            self.limit(best)
        };
        // The fleet's figures the comparison reads, once per decision (not per candidate).
        let avg = cands.iter().map(|c| c.inflight_tokens).sum::<u64>() as f64
            / cands.len().max(1) as f64;
        let stays = |i: usize| {
            let Some(a) = &self.stay_or_move else {
                return false;
            };
            let c = &cands[i];
            if req.matched(c) == 0 || a.over_caps(c.inflight_tokens as f64, avg, c.waiting) {
                return false;
            }
            adaptive_verdict(req, cands, &est, a, i, Others::HoldingLess).stays()
        };
        for (i, (k, e)) in keep.iter_mut().zip(&est).enumerate() {
            if *k && cost(e) > limit && !stays(i) {
                *k = false;
            }
        }
        // And, as the least-cached layer does, not where the prefill harms the returning
        // sessions more than it must ([`harm_cap`]): among those left, at most the least
        // harm plus the room's slack.
        if cold {
            let slack = self.room.map_or(0.0, |(_, slack)| slack);
            let cap = harm_cap(&est, |i| keep[i], slack);
            for (k, e) in keep.iter_mut().zip(&est) {
                if *k && e.harm_ms() > cap {
                    *k = false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::api::cands;

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
    fn stay_or_move_keeps_a_slow_holder_of_a_long_prompt_and_not_of_a_short_one() {
        use crate::prefix::PrefixMatch;
        // 1000 tokens/s, 10 ms step, no room: only the best would stay. Candidate 1 holds
        // the prompt but 5,000 tokens are queued there; candidate 0 is idle and holds nothing.
        let (model, mut cs, _) = three_queues();
        cs.truncate(2);
        cs[0].prefill_tokens = 0;
        cs[1].prefill_tokens = 5000;
        let gate = PredictedTtftScorer::new(model)
            .with_filter(true)
            .with_stay_or_move(Some(Adaptive::default()));
        let view = |m: &'static PrefixMatch, tokens| RequestView {
            prompt_tokens: tokens,
            block_tokens: 16,
            prefix: Some(m),
            ..Default::default()
        };
        // 4,000 tokens, 248 of 250 blocks held: waiting (5,042 ms) costs less than
        // recomputing on 0 (4,010 ms) plus the copy of 3,968 tokens there.
        let long: &'static PrefixMatch = Box::leak(Box::new(PrefixMatch {
            prompt_blocks: 250,
            best: 248,
            per_instance: vec![(cs[1].key, 248)],
        }));
        let mut keep = vec![true; 2];
        gate.filter(&view(long, 4000), &cs, &mut keep);
        assert_eq!(keep, vec![true, true]);
        // 200 tokens, all 12 blocks held: 5,018 ms against 210 + 192 ms: it moves.
        let short: &'static PrefixMatch = Box::leak(Box::new(PrefixMatch {
            prompt_blocks: 12,
            best: 12,
            per_instance: vec![(cs[1].key, 12)],
        }));
        let mut keep = vec![true; 2];
        gate.filter(&view(short, 200), &cs, &mut keep);
        assert_eq!(keep, vec![true, false]);
        // Without stay-or-move the long prompt's holder goes too.
        let plain = gate.clone().with_stay_or_move(None);
        let mut keep = vec![true; 2];
        plain.filter(&view(long, 4000), &cs, &mut keep);
        assert_eq!(keep, vec![true, false]);
        // Past the safety cap on waiting requests it goes whatever the prompt.
        cs[1].waiting = 17;
        let mut keep = vec![true; 2];
        gate.filter(&view(long, 4000), &cs, &mut keep);
        assert_eq!(keep, vec![true, false]);
    }

    #[test]
    fn a_cold_prompt_scores_lower_where_more_sessions_come_back_during_its_prefill() {
        let (model, mut cs, _) = three_queues();
        cs.iter_mut().for_each(|c| c.prefill_tokens = 0);
        // Instance 0's sessions come back once a second (10 within the 10-s time constant).
        for _ in 0..10 {
            model.dispatched(cs[0].key, 30_000);
        }
        let warm = PredictedTtftScorer::new(model).with_temperature_ms(Some(250.0));
        let mut out = vec![0.0; 3];
        let score = |tokens: u64, out: &mut Vec<f64>| {
            let req = RequestView {
                prompt_tokens: tokens,
                block_tokens: 16,
                now_ms: 30_000,
                ..Default::default()
            };
            warm.score(&req, &cs, out);
        };
        // 2,000 tokens prefill 2 s at 1,000 tokens/s: on 0 those arriving meanwhile wait
        // 2 s in all (1/s × 2 s × 1 s), e^-8 against 1 on the quiet ones.
        score(2000, &mut out);
        assert_eq!(out[1], 1.0);
        assert_eq!(out[2], 1.0);
        assert!((out[0] - (-8.0f64).exp()).abs() < 1e-9, "{out:?}");
        // 20 tokens: 0.2 ms of harm, hardly a difference.
        score(20, &mut out);
        assert!(out[0] > 0.99, "{out:?}");
    }

    /// The documented filter's room (tolerance 0.5, slack 50 ms), for the cold-prompt tests.
    fn cold_gate(model: Arc<CostModel>) -> PredictedTtftScorer {
        PredictedTtftScorer::new(model)
            .with_room(Some(CostTolerance {
                tolerance: 0.5,
                slack_ms: 50.0,
            }))
            .with_filter(true)
    }

    /// A prompt of `tokens` at 30 s, held by no one.
    fn cold_request(tokens: u64) -> RequestView<'static> {
        RequestView {
            prompt_tokens: tokens,
            block_tokens: 16,
            now_ms: 30_000,
            ..Default::default()
        }
    }

    #[test]
    fn as_a_filter_a_cold_prompt_is_kept_by_its_estimate_plus_harm() {
        // Instance 0 is a hot tenant's home: a short queue (90 tokens) but sessions coming
        // back once a second; 1 has 400 tokens queued and no arrivals; 2 has 2,000.
        let (model, mut cs, _) = three_queues();
        cs[0].prefill_tokens = 90;
        cs[1].prefill_tokens = 400;
        cs[2].prefill_tokens = 2000;
        for _ in 0..10 {
            model.dispatched(cs[0].key, 30_000);
        }
        let gate = cold_gate(model);
        let req = cold_request;
        // 2,000 cold tokens: estimates 2,100, 2,410 and 4,010 ms. On 0 those arriving in the
        // next 2 s wait behind it until the fleet's mean queue (830 ms) and half the prefill
        // have passed: 1/s × 2 s × 1.83 s = 3,660 ms of harm. On TTFT alone 0 and 1 are
        // within the room (2,100 × 1.5 + 50); with the harm 0 costs 5,760 ms against 1's
        // 2,410, beyond 2,410 + 2,100 × 0.5 + 50 = 3,510.
        let mut keep = vec![true; 3];
        gate.filter(&req(2000), &cs, &mut keep);
        assert_eq!(keep, vec![false, true, false]);
        // A prompt someone holds part of is kept by its estimate alone (the stay-or-move
        // comparison prices what a holder saves).
        use crate::prefix::PrefixMatch;
        let m: &'static PrefixMatch = Box::leak(Box::new(PrefixMatch {
            prompt_blocks: 125,
            best: 2,
            per_instance: vec![(cs[2].key, 2)],
        }));
        let mut keep = vec![true; 3];
        let warm = RequestView {
            prefix: Some(m),
            ..req(2000)
        };
        gate.filter(&warm, &cs, &mut keep);
        assert_eq!(keep, vec![true, true, false]);
    }

    #[test]
    fn as_a_filter_a_cold_prompt_does_not_go_where_it_harms_more_than_it_must() {
        // Instance 0 is idle but its sessions come back (0.1/s); 1 and 2 have 1,000 tokens
        // queued and none coming back.
        let (model, mut cs, _) = three_queues();
        cs[0].prefill_tokens = 0;
        cs[1].prefill_tokens = 1000;
        cs[2].prefill_tokens = 1000;
        model.dispatched(cs[0].key, 30_000);
        let gate = cold_gate(model);
        let req = cold_request;
        // 2,000 cold tokens: 0 estimates 2,010 ms plus 0.1/s × 2 s × (667 ms fleet mean queue
        // + 1 s) = 333 ms of harm, 2,343 in all, the least; 1 and 2 estimate 3,010 with no
        // harm, within the room (2,343 + 2,010 × 0.5 + 50). Among those three the least harm
        // is 0, so 0's 333 ms is beyond its slack: the prompt waits a little longer on 1 or 2
        // rather than stall the sessions coming back to 0.
        let mut keep = vec![true; 3];
        gate.filter(&req(2000), &cs, &mut keep);
        assert_eq!(keep, vec![false, true, true]);
        // 200 tokens harm 0 by 0.1/s × 0.2 s × 0.77 s = 15 ms: 0 (225 ms in all) is the only
        // one within the room, and the cap is over those the room kept.
        let mut keep = vec![true; 3];
        gate.filter(&req(200), &cs, &mut keep);
        assert_eq!(keep, vec![true, false, false]);
    }
}
