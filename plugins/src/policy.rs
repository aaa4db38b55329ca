//! Policy mode: weighted plugin scoring.
//!
//! Every enabled plugin ([`Scorer`]) scores every candidate. Each plugin's scores are
//! normalised over the candidates — divided by their sum, so they sum to 1 (a plugin whose
//! scores are all 0 abstains: it adds nothing to anyone). The total of a candidate is
//! `Σ weight × normalised score`; the highest total wins. Exact ties are broken at random with
//! the caller's RNG (seeded in tests). "Exact" means equal up to floating-point rounding
//! (relative 1e-9): mathematically equal totals such as 4/7 + 1/7 and 2/7 + 3/7 may differ in
//! the last bit after division, and such a tie must still be a tie.
//!
//! Default weights: 1. (The decision service is not a scorer: it is a filter in front of the
//! picker, [`crate::filter::DecisionTarget`], so its answer restricts the candidates to the
//! target it named.)
//!
//! # When does a session move? (the switching table)
//! N candidates, the session bound to one with `x` requests in flight, all others idle.
//! Affinity raw scores are `1, 1/2, 1/4, …, 2^-(N-1)` (sum `2(1 − 2^-N)`), so after
//! normalisation the bound instance leads the runner-up (rank 1) by
//! `0.5 / (2(1 − 2^-N))`. In-flight raw scores are `1/(1+x)` for the bound instance and 1 for
//! the others (sum `((1+x)(N−1)+1)/(1+x)`), so every idle instance leads the bound one by
//! `x / ((1+x)(N−1)+1)`. The runner-up is the only idle instance that can overtake, so the
//! session moves when `w_inflight × x/((1+x)(N−1)+1) > w_affinity × 0.5/(2(1 − 2^-N))` and
//! ties at equality. As `x → ∞` the in-flight lead tends to `1/(N−1)`: with equal weights
//! the session never moves once N ≥ 5. See the `switching_table` test.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use rand::{Rng, RngCore};

use crate::candidate::{Candidate, Needs, RequestView};
use crate::decision::{AffinityOutcome, Decision, Dropped, Layer, PolicyTrace, Trace};
use crate::pipeline::{Completion, Picker};
use crate::scorer::Scorer;

/// Relative tolerance under which two totals are a tie.
const TIE_EPS: f64 = 1e-9;

/// A policy that cannot be built.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyError {
    NoPlugins,
    /// `plugins[index]` has a weight that is not a positive finite number.
    BadWeight {
        index: usize,
        weight: f64,
    },
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::NoPlugins => f.write_str("a policy needs at least one scoring plugin"),
            PolicyError::BadWeight { index, weight } => write!(
                f,
                "plugins[{index}].weight: {weight} is not a positive number"
            ),
        }
    }
}

impl std::error::Error for PolicyError {}

struct Weighted {
    scorer: Arc<dyn Scorer>,
    weight: f64,
}

/// Policy mode: Σ weight × normalised score over its scorers. See the module docs.
pub struct WeightedSum {
    plugins: Vec<Weighted>,
}

impl fmt::Debug for WeightedSum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut l = f.debug_list();
        for p in &self.plugins {
            l.entry(&(p.scorer.name(), p.weight));
        }
        l.finish()
    }
}

impl WeightedSum {
    /// A picker over scorers with their weights (the order of the reason string).
    pub fn new(plugins: Vec<(Arc<dyn Scorer>, f64)>) -> Result<Self, PolicyError> {
        if plugins.is_empty() {
            return Err(PolicyError::NoPlugins);
        }
        let plugins = plugins
            .into_iter()
            .enumerate()
            .map(|(index, (scorer, weight))| {
                if weight.is_finite() && weight > 0.0 {
                    Ok(Weighted { scorer, weight })
                } else {
                    Err(PolicyError::BadWeight { index, weight })
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(WeightedSum { plugins })
    }
}

impl Picker for WeightedSum {
    fn name(&self) -> &'static str {
        "policy"
    }

    fn needs(&self) -> Needs {
        self.plugins
            .iter()
            .fold(Needs::NONE, |n, w| n | w.scorer.needs())
    }

    /// Chooses one of `cands`; `rng` breaks exact ties. `None` only when `cands` is empty.
    /// Plugins that filter ([`Scorer::filter`]) first remove candidates; the others are scored
    /// among the rest (never all removed: a filter that would leave none is ignored).
    fn pick(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let d = self.filter_and_sum(req, cands, rng)?;
        Some(self.with_estimates(d, req, cands))
    }

    /// The request was sent to `chosen` (binds the session, …).
    fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        for w in &self.plugins {
            w.scorer.on_dispatch(req, chosen);
        }
    }

    fn on_complete(&self, req: &RequestView<'_>, chosen: &Candidate, done: &Completion) {
        for w in &self.plugins {
            w.scorer.on_complete(req, chosen, done);
        }
    }
}

impl WeightedSum {
    /// [`Picker::pick`] without the explanation's estimates: the filters, then the sum over
    /// the candidates they left.
    fn filter_and_sum(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        if cands.is_empty() {
            return None;
        }
        if !self.plugins.iter().any(|w| w.scorer.filters()) {
            return self.sum(req, cands, rng);
        }
        let mut dropped = Vec::new();
        let mut keep = vec![true; cands.len()];
        let mut before = keep.clone();
        for w in self.plugins.iter().filter(|w| w.scorer.filters()) {
            before.copy_from_slice(&keep);
            w.scorer.filter(req, cands, &mut keep);
            if !keep.iter().any(|k| *k) {
                keep.copy_from_slice(&before);
                continue;
            }
            for (i, (b, k)) in before.iter().zip(&keep).enumerate() {
                if *b && !*k {
                    dropped.push(Dropped {
                        idx: cands[i].idx,
                        by: w.scorer.name(),
                    });
                }
            }
        }
        if dropped.is_empty() {
            return self.sum(req, cands, rng);
        }
        let (pos, kept): (Vec<usize>, Vec<Candidate>) = cands
            .iter()
            .enumerate()
            .filter(|(i, _)| keep[*i])
            .map(|(i, c)| (i, *c))
            .unzip();
        let mut d = self.sum(req, &kept, rng)?;
        d.pos = pos[d.pos];
        // The reason says how many candidates each filtering plugin took out:
        // `policy(…) filtered(ttft:2)`.
        let mut reason = d.reason.into_owned();
        reason.push_str(" filtered(");
        let mut named: Vec<&str> = Vec::new();
        for x in &dropped {
            if named.contains(&x.by) {
                continue;
            }
            let n = dropped.iter().filter(|y| y.by == x.by).count();
            use std::fmt::Write as _;
            let sep = if named.is_empty() { "" } else { "," };
            let _ = write!(reason, "{sep}{}:{n}", x.by);
            named.push(x.by);
        }
        reason.push(')');
        d.reason = Cow::Owned(reason);
        d.dropped = dropped;
        Some(d)
    }

    /// An explained decision carries the predicted-TTFT plugin's estimates of every candidate,
    /// the filtered ones too (why a cold prompt went where it went).
    fn with_estimates(
        &self,
        mut d: Decision,
        req: &RequestView<'_>,
        cands: &[Candidate],
    ) -> Decision {
        if !req.explain {
            return d;
        }
        let Some((cold, est)) = self
            .plugins
            .iter()
            .find_map(|w| w.scorer.estimates(req, cands))
        else {
            return d;
        };
        if let Trace::Policy(t) = &mut d.trace {
            t.cold = cold;
            t.estimates = cands.iter().map(|c| c.idx).zip(est).collect();
        }
        d
    }

    /// The weighted sum over `cands` (not empty).
    fn sum(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let n = cands.len();
        if n == 0 {
            return None;
        }
        let p = self.plugins.len();
        let mut norm = vec![0.0; p * n];
        let mut totals = vec![0.0; n];
        for (j, w) in self.plugins.iter().enumerate() {
            let out = &mut norm[j * n..(j + 1) * n];
            w.scorer.score(req, cands, out);
            let mut sum = 0.0;
            for x in out.iter_mut() {
                if !(x.is_finite() && *x > 0.0) {
                    *x = 0.0;
                }
                sum += *x;
            }
            if sum > 0.0 && sum.is_finite() {
                for (x, t) in out.iter_mut().zip(totals.iter_mut()) {
                    *x /= sum;
                    *t += w.weight * *x;
                }
            } else {
                out.fill(0.0);
            }
        }
        let max = totals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let tol = TIE_EPS * max.abs().max(f64::MIN_POSITIVE);
        let tied: Vec<usize> = (0..n).filter(|&i| max - totals[i] <= tol).collect();
        let pos = if tied.len() == 1 {
            tied[0]
        } else {
            tied[rng.gen_range(0..tied.len())]
        };

        let mut reason = String::with_capacity(16 + 24 * p);
        reason.push_str("policy(");
        for (j, w) in self.plugins.iter().enumerate() {
            if j > 0 {
                reason.push(',');
            }
            use std::fmt::Write as _;
            let _ = write!(
                reason,
                "{}={:.1}*{:.2}",
                w.scorer.name(),
                w.weight,
                norm[j * n + pos]
            );
        }
        reason.push(')');

        Some(Decision {
            pos,
            idx: cands[pos].idx,
            key: cands[pos].key,
            layer: Layer::Policy,
            reason: Cow::Owned(reason),
            affinity: AffinityOutcome::Off,
            prompt_blocks: 0,
            matched_blocks: 0,
            best_matched_blocks: 0,
            trace: Trace::Policy(PolicyTrace {
                names: self.plugins.iter().map(|w| w.scorer.name()).collect(),
                weights: self.plugins.iter().map(|w| w.weight).collect(),
                norm,
                totals,
                idxs: cands.iter().map(|c| c.idx).collect(),
                tied: tied.len(),
                estimates: Vec::new(),
                cold: false,
            }),
            dropped: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::DecisionTarget;
    use crate::hash::{InstanceKey, SessionKey};
    use crate::pipeline::{Outcome, Pipeline};
    use crate::prefix::PrefixIndex;
    use crate::scorer::{
        LeastInflightScorer, LeastTokenScorer, PrefixScorer, SessionAffinityScorer,
    };
    use crate::session::SessionTable;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn cands(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                idx: i,
                key: InstanceKey::of(&format!("inst-{i}")),
                ..Default::default()
            })
            .collect()
    }

    fn affinity_inflight(sessions: &Arc<SessionTable>, wi: f64, wa: f64) -> WeightedSum {
        WeightedSum::new(vec![
            (Arc::new(SessionAffinityScorer::new(sessions.clone())), wa),
            (Arc::new(LeastInflightScorer), wi),
        ])
        .unwrap()
    }

    /// Does the lead of the runner-up in flight beat the lead of the bound instance in
    /// affinity? Exact integer form of
    /// `wi·x/((1+x)(N−1)+1)  vs  wa·0.5/(2(1 − 2^-N))`, multiplied out by
    /// `4·2^N·((1+x)(N−1)+1)` (weights given as integers).
    fn formula(n: u32, x: u64, wi: u64, wa: u64) -> std::cmp::Ordering {
        let p = 1u128 << n;
        let lhs = u128::from(wi) * u128::from(x) * 4 * (p - 1);
        let rhs = u128::from(wa) * p * ((1 + u128::from(x)) * u128::from(n - 1) + 1);
        lhs.cmp(&rhs)
    }

    #[test]
    fn switching_table() {
        const SEEDS: u64 = 24;
        const MAX_X: u64 = 1000;
        let mut table = String::new();
        let mut ties_seen = Vec::new();
        for (wi, wa) in [(1u64, 1u64), (2, 1), (1, 2), (4, 1)] {
            for n in 2..=8u32 {
                let sessions = Arc::new(SessionTable::default());
                let picker = affinity_inflight(&sessions, wi as f64, wa as f64);
                let mut cs = cands(n as usize);
                let s = SessionKey::of(&format!("session-{n}-{wi}-{wa}"));
                // Bind to the last candidate so position order plays no part.
                let bound = n as usize - 1;
                sessions.bind(s, cs[bound].key, 0);
                let req = RequestView {
                    session: Some(s),
                    ..Default::default()
                };
                let mut measured = None;
                let mut expected = None;
                for x in 1..=MAX_X {
                    cs[bound].inflight_requests = x;
                    let mut moved = 0;
                    for seed in 0..SEEDS {
                        let d = picker
                            .pick(&req, &cs, &mut StdRng::seed_from_u64(seed))
                            .unwrap();
                        if d.pos != bound {
                            moved += 1;
                        }
                    }
                    let f = formula(n, x, wi, wa);
                    match f {
                        std::cmp::Ordering::Less => {
                            assert_eq!(moved, 0, "N={n} x={x} {wi}:{wa} moved but should stay")
                        }
                        std::cmp::Ordering::Equal => {
                            assert!(
                                moved > 0 && moved < SEEDS,
                                "N={n} x={x} {wi}:{wa} is an exact tie: both outcomes expected, moved {moved}/{SEEDS}"
                            );
                            ties_seen.push((n, x, wi, wa));
                        }
                        std::cmp::Ordering::Greater => {
                            assert_eq!(moved, SEEDS, "N={n} x={x} {wi}:{wa} should move");
                            expected.get_or_insert(x);
                        }
                    }
                    if moved == SEEDS && measured.is_none() {
                        measured = Some(x);
                    }
                    if measured.is_some() && expected.is_some() {
                        break;
                    }
                }
                assert_eq!(measured, expected, "N={n} {wi}:{wa}");
                table.push_str(&format!(
                    "{wi}:{wa} N={n} -> {}\n",
                    measured.map_or("never".into(), |x| x.to_string())
                ));
            }
        }
        // The table (w_inflight:w_affinity, lowest x that moves the session).
        let expect = "\
1:1 N=2 -> 2\n1:1 N=3 -> 3\n1:1 N=4 -> 6\n1:1 N=5 -> never\n1:1 N=6 -> never\n1:1 N=7 -> never\n1:1 N=8 -> never\n\
2:1 N=2 -> 1\n2:1 N=3 -> 1\n2:1 N=4 -> 1\n2:1 N=5 -> 2\n2:1 N=6 -> 3\n2:1 N=7 -> 4\n2:1 N=8 -> 9\n\
1:2 N=2 -> 5\n1:2 N=3 -> never\n1:2 N=4 -> never\n1:2 N=5 -> never\n1:2 N=6 -> never\n1:2 N=7 -> never\n1:2 N=8 -> never\n\
4:1 N=2 -> 1\n4:1 N=3 -> 1\n4:1 N=4 -> 1\n4:1 N=5 -> 1\n4:1 N=6 -> 1\n4:1 N=7 -> 1\n4:1 N=8 -> 1\n";
        assert_eq!(table, expect);
        // Exact ties: N=2 x=1 1:1 (the documented one), N=3 x=2 1:1, N=2 x=4 1:2.
        assert_eq!(ties_seen, vec![(2, 1, 1, 1), (3, 2, 1, 1), (2, 4, 1, 2)]);
    }

    #[test]
    fn the_n2_x1_tie_breaks_both_ways() {
        let sessions = Arc::new(SessionTable::default());
        let picker = affinity_inflight(&sessions, 1.0, 1.0);
        let mut cs = cands(2);
        let s = SessionKey::of("tie");
        sessions.bind(s, cs[0].key, 0);
        cs[0].inflight_requests = 1;
        let req = RequestView {
            session: Some(s),
            ..Default::default()
        };
        let mut seen = [0; 2];
        for seed in 0..200 {
            let d = picker
                .pick(&req, &cs, &mut StdRng::seed_from_u64(seed))
                .unwrap();
            match &d.trace {
                Trace::Policy(t) => assert_eq!(t.tied, 2),
                _ => unreachable!(),
            }
            seen[d.pos] += 1;
        }
        assert!(seen[0] > 60 && seen[1] > 60, "{seen:?}");
        // The same seed gives the same answer.
        let a = picker
            .pick(&req, &cs, &mut StdRng::seed_from_u64(5))
            .unwrap();
        let b = picker
            .pick(&req, &cs, &mut StdRng::seed_from_u64(5))
            .unwrap();
        assert_eq!(a.pos, b.pos);
    }

    #[test]
    fn reason_shows_the_winners_contributions() {
        let sessions = Arc::new(SessionTable::default());
        let picker = affinity_inflight(&sessions, 1.0, 1.0);
        let mut cs = cands(2);
        let s = SessionKey::of("r");
        sessions.bind(s, cs[0].key, 0);
        cs[0].inflight_requests = 3; // bound: aff 2/3, inflight 0.25/1.25 = 0.2
        let req = RequestView {
            session: Some(s),
            ..Default::default()
        };
        let d = picker
            .pick(&req, &cs, &mut StdRng::seed_from_u64(0))
            .unwrap();
        assert_eq!(d.pos, 1);
        assert_eq!(d.reason, "policy(affinity=1.0*0.33,inflight=1.0*0.80)");
        let e = d.explain_with(|i| format!("inst-{i}"));
        eprintln!("{e}");
        assert!(e.contains("total = 1*affinity + 1*inflight"), "{e}");
        assert!(
            e.contains("inst-0:total=0.8667,affinity=0.667,inflight=0.200"),
            "{e}"
        );
    }

    #[test]
    fn the_decision_filter_restricts_to_the_named_target_or_abstains() {
        let p =
            Pipeline::new(WeightedSum::new(vec![(Arc::new(LeastInflightScorer), 1.0)]).unwrap())
                .filter(DecisionTarget);
        assert_eq!(p.needs(), Needs::DECISION);
        let mut cs = cands(3);
        cs[0].inflight_requests = 5;
        cs[2].target = 1;
        let mut rng = StdRng::seed_from_u64(1);
        // Abstain: least in-flight decides (1 and 2 tie; both are fine).
        let d = p.pick(&RequestView::default(), &cs, &mut rng).unwrap();
        assert_ne!(d.pos, 0);
        assert_eq!(d.reason, "policy(inflight=1.0*0.46)");
        // The decision service names target 1: its only instance wins however busy it is.
        cs[2].inflight_requests = 50;
        let r = RequestView {
            decision: Some(1),
            ..Default::default()
        };
        let d = p.pick(&r, &cs, &mut rng).unwrap();
        assert_eq!(d.pos, 2);
        assert_eq!(d.dropped.len(), 2);
        // A target without candidates: abstain.
        let r = RequestView {
            decision: Some(9),
            ..Default::default()
        };
        assert_eq!(p.pick(&r, &cs, &mut rng).unwrap().pos, 1);
    }

    #[test]
    fn a_ttft_filter_overrides_any_weight_and_says_what_it_dropped() {
        use crate::cost::{CostConfig, CostModel};
        use crate::filter::NotTried;
        use crate::layered::CostTolerance;
        use crate::scorer::PredictedTtftScorer;
        // 1000 tokens/s, 10 ms steps: a 10-token prompt estimates 20, 110 and 510 ms.
        let model = Arc::new(CostModel::new(CostConfig {
            prior_prefill_tps: 1000.0,
            prior_step_ms: 10.0,
            ..CostConfig::default()
        }));
        let ttft = |filter| {
            Arc::new(
                PredictedTtftScorer::new(model.clone())
                    .with_room(Some(CostTolerance {
                        tolerance: 0.5,
                        slack_ms: 100.0,
                    }))
                    .with_filter(filter),
            )
        };
        let sessions = Arc::new(SessionTable::default());
        let mut cs = cands(3);
        cs[1].prefill_tokens = 90;
        cs[2].prefill_tokens = 490;
        let s = SessionKey::of("stuck");
        sessions.bind(s, cs[2].key, 0);
        let req = RequestView {
            session: Some(s),
            prompt_tokens: 10,
            block_tokens: 16,
            ..Default::default()
        };
        let aff = || Arc::new(SessionAffinityScorer::new(sessions.clone()));
        let mut rng = StdRng::seed_from_u64(3);
        // Scored only: an affinity weight of 100 keeps the session on the 510-ms queue.
        let soft = WeightedSum::new(vec![(ttft(false), 1.0), (aff(), 100.0)]).unwrap();
        assert_eq!(soft.pick(&req, &cs, &mut rng).unwrap().pos, 2);
        // As a filter: the queue beyond 130 ms is out whatever the weight, and the
        // explanation says which plugin took it out.
        let p = Pipeline::new(WeightedSum::new(vec![(ttft(true), 1.0), (aff(), 100.0)]).unwrap())
            .filter(NotTried);
        let d = p.pick(&req, &cs, &mut rng).unwrap();
        assert_ne!(d.pos, 2);
        assert_eq!(d.dropped, vec![Dropped { idx: 2, by: "ttft" }]);
        assert!(
            d.explain().contains("filtered out: #2(ttft)"),
            "{}",
            d.explain()
        );
        assert!(d.reason.ends_with(" filtered(ttft:1)"), "{}", d.reason);
        match &d.trace {
            Trace::Policy(t) => assert_eq!(t.idxs, vec![0, 1], "only the kept are scored"),
            _ => unreachable!(),
        }
        // Explained, the estimates of every candidate are shown, the filtered one too (a
        // prompt held nowhere: with its harm and follow, 0 here, nothing having been routed).
        let explained = RequestView {
            explain: true,
            ..req
        };
        let e = p.pick(&explained, &cs, &mut rng).unwrap().explain();
        assert!(
            e.contains(" | ttft (cold prompt: est + harm + follow): #0:est=20ms("),
            "{e}"
        );
        assert!(
            e.contains(" #2:est=510ms(q=490+own=10+dec=10 @1.0k/s prior)=510ms"),
            "{e}"
        );
        // The pipeline's own filters come first in the list; both are named.
        let tried = [cs[0].key];
        let r = RequestView {
            exclude: &tried,
            ..req
        };
        let d = p.pick(&r, &cs, &mut rng).unwrap();
        assert_eq!(d.pos, 1);
        assert_eq!(
            d.dropped,
            vec![
                Dropped {
                    idx: 0,
                    by: "tried"
                },
                Dropped { idx: 2, by: "ttft" }
            ]
        );
    }

    #[test]
    fn prefix_plugin_joins_a_policy_and_reports_figures() {
        let index = PrefixIndex::default();
        let p = Pipeline::new(
            WeightedSum::new(vec![
                (Arc::new(PrefixScorer::default()), 2.0),
                (Arc::new(LeastTokenScorer::default()), 1.0),
            ])
            .unwrap(),
        );
        assert_eq!(p.needs(), Needs::PREFIX);
        let mut cs = cands(3);
        let prompt = [1u64, 2, 3, 4];
        index.insert(&prompt, cs[2].key, 0);
        cs[2].inflight_tokens = 1000;
        let m = index.match_prefix(&prompt, 0);
        let req = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            ..Default::default()
        };
        let d = p.pick(&req, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        // 2*1 + 1*(0.5/2.5) = 2.2 vs 0 + 1*(1/2.5) = 0.4
        assert_eq!(d.pos, 2);
        assert_eq!(
            (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
            (4, 4, 4)
        );
        assert_eq!(d.reason, "policy(prefix=2.0*1.00,tokens=1.0*0.20)");
    }

    #[test]
    fn bad_configs_are_rejected() {
        assert_eq!(
            WeightedSum::new(vec![]).unwrap_err(),
            PolicyError::NoPlugins
        );
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = WeightedSum::new(vec![(Arc::new(LeastInflightScorer), w)]).unwrap_err();
            assert!(e.to_string().starts_with("plugins[0].weight"), "{e}");
        }
    }

    #[test]
    fn on_dispatch_binds_the_session() {
        let sessions = Arc::new(SessionTable::default());
        let picker = affinity_inflight(&sessions, 1.0, 1.0);
        let cs = cands(4);
        let s = SessionKey::of("abc");
        let req = RequestView {
            session: Some(s),
            ..Default::default()
        };
        let d = picker
            .pick(&req, &cs, &mut StdRng::seed_from_u64(0))
            .unwrap();
        picker.on_dispatch(&req, &cs[d.pos]);
        picker.on_complete(&req, &cs[d.pos], &Completion::of(Outcome::Completed));
        assert_eq!(sessions.get(s, 0), Some(cs[d.pos].key));
        // Idle fleet: the session stays where it was bound.
        for seed in 0..20 {
            let d2 = picker
                .pick(&req, &cs, &mut StdRng::seed_from_u64(seed))
                .unwrap();
            assert_eq!(d2.pos, d.pos);
        }
    }
}
