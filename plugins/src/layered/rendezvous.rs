//! Rendezvous placement ([`RendezvousStage`]): where replicas that never talk agree to put
//! a new session or a new prefix (`cluster: {placement: rendezvous}`).

use std::borrow::Cow;
use std::fmt::Write as _;

use super::ctx::{Hit, LayerCtx, Stage};
use super::prefix::PREFIX_SPILL;
use crate::candidate::{Candidate, Needs};
use crate::decision::{AffinityOutcome, Layer};
use crate::hash::{rendezvous, InstanceKey, SessionKey};

/// Reason of a new session placed by its session key.
pub const RENDEZVOUS_SESSION: &str = "rendezvous(session)";
/// Reason of a request without a session placed by its prompt's first block (a new prefix's
/// home).
pub const RENDEZVOUS_PREFIX: &str = "rendezvous(prefix)";

/// Where a request goes that no earlier layer placed (a new session, a prefix cached nowhere),
/// chosen only from what every gateway replica sees alike, so that replicas sharing no state
/// choose the same instance: weighted rendezvous hashing of a key over the candidates.
///
/// * The key: the session key when the request has one, else the prompt's first block hash
///   (every request opening with the same block — a tenant's system prompt — gets the same
///   home). Neither (a prompt shorter than one block, no session): the request falls through
///   to the next layer. So does a request an earlier layer moved away from where it was
///   (`affinity-escape`, `prefix-spill`): its home by the hash may be the very instance it
///   left, and the replica that judged it too busy there knows why.
/// * The load: the engines' own figures, scraped (`engine_metrics`: running + waiting), never
///   the replica's in-flight counts (each replica knows only its own share). An instance
///   whose engine is not scraped counts 0.
/// * Eligible: the candidates whose load ≤ least + `slack` + least × `tolerance`; the others
///   are too busy to take a new session.
/// * Weight `w = (least + slack + 1) / (max(load, least + slack) + 1)`: 1 within `slack` of
///   the least loaded (two replicas that scraped a moment apart still agree), less for the
///   busier. Score `-w / ln(u)`, `u` the key's hash with the instance in (0, 1); the highest
///   wins, so an instance takes a share of the keys proportional to its weight, and an
///   instance joining or leaving moves only the keys it wins or held.
///
/// Reason `rendezvous(session)` or `rendezvous(prefix)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RendezvousStage {
    /// Running + waiting requests within which instances count as equally loaded.
    pub slack: u32,
    /// Eligible up to least + slack + least × this.
    pub tolerance: f64,
}

impl Default for RendezvousStage {
    fn default() -> Self {
        RendezvousStage {
            slack: 2,
            tolerance: 0.5,
        }
    }
}

/// An instance's load as every replica sees it: its engine's running + waiting requests
/// (scraped), 0 when not scraped.
pub(super) fn scraped_load(c: &Candidate) -> u64 {
    c.engine
        .map_or(0, |e| u64::from(e.running) + u64::from(e.waiting))
}

/// `u` in (0, 1) from a 64-bit hash (its top 53 bits, centred: never 0 or 1).
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// The weighted rendezvous score of `key` on `instance` (higher wins): `-w / ln(u)`.
pub(super) fn score(key: u64, instance: InstanceKey, weight: f64) -> f64 {
    -weight / unit(rendezvous(SessionKey(key), instance)).ln()
}

/// The position in `items` (instance, weight) with the highest score for `key`; weights ≤ 0
/// never win. Ties (equal scores: practically never) go to the lower instance key, so the
/// choice does not depend on the order of `items`.
pub(super) fn choose(
    key: u64,
    items: impl IntoIterator<Item = (InstanceKey, f64)>,
) -> Option<usize> {
    let mut best: Option<(usize, f64, InstanceKey)> = None;
    for (i, (inst, w)) in items.into_iter().enumerate() {
        if w.is_nan() || w <= 0.0 {
            continue;
        }
        let s = score(key, inst, w);
        if best.is_none_or(|(_, bs, bk)| s > bs || (s == bs && inst < bk)) {
            best = Some((i, s, inst));
        }
    }
    best.map(|(i, _, _)| i)
}

impl RendezvousStage {
    /// Each candidate's weight (0: not eligible), from the scraped loads.
    pub fn weight(&self, load: u64, least: u64) -> f64 {
        let slack = u64::from(self.slack);
        let band = least as f64 * (1.0 + self.tolerance) + slack as f64;
        if load as f64 > band {
            return 0.0;
        }
        (least + slack + 1) as f64 / (load.max(least + slack) + 1) as f64
    }
}

impl Stage for RendezvousStage {
    fn name(&self) -> &'static str {
        "rendezvous"
    }

    fn needs(&self) -> Needs {
        Needs::SESSION | Needs::ENGINE
    }

    fn try_pick(&self, cx: &mut LayerCtx<'_, '_>) -> Option<Hit> {
        if cx.affinity == AffinityOutcome::Escape || cx.headline.as_deref() == Some(PREFIX_SPILL) {
            if cx.req.explain {
                cx.notes
                    .push("rendezvous: moved away by an earlier layer: next layer".into());
            }
            return None;
        }
        let (key, reason) = match (cx.req.session, cx.req.blocks.first()) {
            (Some(s), _) => (s.0, RENDEZVOUS_SESSION),
            (None, Some(&b)) => (b, RENDEZVOUS_PREFIX),
            (None, None) => {
                if cx.req.explain {
                    cx.notes
                        .push("rendezvous: no session and no full block: next layer".into());
                }
                return None;
            }
        };
        let least = cx.cands.iter().map(scraped_load).min()?;
        let pos = choose(
            key,
            cx.cands
                .iter()
                .map(|c| (c.key, self.weight(scraped_load(c), least))),
        )?;
        if cx.req.explain {
            let mut s = format!(
                "rendezvous: by {}, scraped running+waiting (eligible <= {least}*(1+{})+{}):",
                if reason == RENDEZVOUS_SESSION {
                    "session"
                } else {
                    "first block"
                },
                self.tolerance,
                self.slack
            );
            for c in cx.cands {
                let l = scraped_load(c);
                let _ = write!(s, " #{}:{l}(w {:.2})", c.idx, self.weight(l, least));
            }
            cx.notes.push(s);
        }
        Some(Hit {
            pos,
            layer: Layer::Balance,
            reason: Cow::Borrowed(reason),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::EngineLoad;

    fn keys(n: usize) -> Vec<InstanceKey> {
        (0..n).map(|i| InstanceKey::of(&format!("e{i}"))).collect()
    }

    #[test]
    fn same_inputs_same_choice_whatever_the_order() {
        let ks = keys(5);
        for key in 0..200u64 {
            let a = choose(key, ks.iter().map(|&k| (k, 1.0))).unwrap();
            let b = choose(key, ks.iter().map(|&k| (k, 1.0))).unwrap();
            assert_eq!(a, b);
            // The same instance when the candidates come in another order.
            let rev: Vec<_> = ks.iter().rev().copied().collect();
            let c = choose(key, rev.iter().map(|&k| (k, 1.0))).unwrap();
            assert_eq!(ks[a], rev[c]);
        }
        assert_eq!(choose(1, std::iter::empty()), None);
        assert_eq!(choose(1, ks.iter().map(|&k| (k, 0.0))), None);
    }

    #[test]
    fn keys_spread_and_weight_shifts_the_share() {
        let ks = keys(2);
        let n = 20_000u64;
        let share = |w1: f64| {
            (0..n)
                .filter(|&key| {
                    choose(
                        key.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                        [(ks[0], 1.0), (ks[1], w1)],
                    ) == Some(1)
                })
                .count() as f64
                / n as f64
        };
        let even = share(1.0);
        assert!((even - 0.5).abs() < 0.02, "{even}");
        // Half the weight: a third of the keys (w / Σw).
        let half = share(0.5);
        assert!((half - 1.0 / 3.0).abs() < 0.02, "{half}");
    }

    #[test]
    fn an_instance_leaving_moves_only_its_keys() {
        let ks = keys(4);
        let before: Vec<usize> = (0..2000u64)
            .map(|k| choose(k, ks.iter().map(|&i| (i, 1.0))).unwrap())
            .collect();
        // e2 leaves.
        let left: Vec<_> = ks.iter().copied().filter(|&k| k != ks[2]).collect();
        let mut moved = 0;
        for (k, &b) in before.iter().enumerate() {
            let a = left[choose(k as u64, left.iter().map(|&i| (i, 1.0))).unwrap()];
            if b == 2 {
                moved += 1;
            } else {
                assert_eq!(a, ks[b], "key {k} moved though its instance stayed");
            }
        }
        assert!(moved > 300 && moved < 700, "{moved}");
    }

    #[test]
    fn places_new_sessions_and_prefixes_alike_and_leaves_escapes_to_the_next_layer() {
        use crate::candidate::RequestView;
        use crate::decision::AffinityOutcome;
        let cands: Vec<Candidate> = keys(4)
            .into_iter()
            .enumerate()
            .map(|(idx, key)| Candidate {
                idx,
                key,
                // This replica's own in-flight counts differ wildly; they do not count.
                inflight_requests: (idx as u64) * 7,
                ..Candidate::default()
            })
            .collect();
        let st = RendezvousStage::default();
        let run = |req: &RequestView<'_>, cands: &[Candidate], affinity, headline| {
            let mut rows = vec![super::super::ctx::Row::default(); cands.len()];
            let mut rng = rand::rngs::mock::StepRng::new(0, 1);
            let mut cx = LayerCtx {
                req,
                cands,
                est: &[],
                min_est: f64::INFINITY,
                rng: &mut rng,
                policy: crate::balance::LbPolicy::LeastToken,
                rows: &mut rows,
                avg_load: 0.0,
                affinity,
                headline,
                notes: Vec::new(),
            };
            st.try_pick(&mut cx).map(|h| (cands[h.pos].key, h.reason))
        };
        let blocks = [42u64, 43];
        let sess = RequestView {
            session: Some(SessionKey::of("s")),
            blocks: &blocks,
            ..RequestView::default()
        };
        let (home, why) = run(&sess, &cands, AffinityOutcome::Unbound, None).unwrap();
        assert_eq!(why, RENDEZVOUS_SESSION);
        // Another replica: other in-flight counts, candidates in another order.
        let mut other = cands.clone();
        other.reverse();
        for c in &mut other {
            c.inflight_requests = 0;
        }
        assert_eq!(
            run(&sess, &other, AffinityOutcome::Unbound, None)
                .unwrap()
                .0,
            home
        );
        // The engine of the home is busy (scraped): the session goes elsewhere.
        let mut busy = cands.clone();
        for c in &mut busy {
            c.engine = Some(EngineLoad {
                running: if c.key == home { 9 } else { 1 },
                ..EngineLoad::default()
            });
        }
        assert_ne!(
            run(&sess, &busy, AffinityOutcome::Unbound, None).unwrap().0,
            home
        );
        let anon = RequestView {
            blocks: &blocks,
            ..RequestView::default()
        };
        assert_eq!(
            run(&anon, &cands, AffinityOutcome::NoSession, None)
                .unwrap()
                .1,
            RENDEZVOUS_PREFIX
        );
        // Moved away by an earlier layer, or nothing to hash: the next layer.
        assert!(run(&sess, &cands, AffinityOutcome::Escape, None).is_none());
        let spill = Some(Cow::Borrowed(PREFIX_SPILL));
        assert!(run(&anon, &cands, AffinityOutcome::NoSession, spill).is_none());
        let none = RequestView::default();
        assert!(run(&none, &cands, AffinityOutcome::NoSession, None).is_none());
    }

    #[test]
    fn weights_are_flat_within_the_slack_and_zero_past_the_band() {
        let st = RendezvousStage::default();
        assert_eq!(st.weight(0, 0), 1.0);
        assert_eq!(st.weight(2, 0), 1.0);
        assert_eq!(st.weight(3, 0), 0.0);
        // least 10: flat to 12, then less, eligible to 17.
        assert_eq!(st.weight(12, 10), 1.0);
        assert!(st.weight(16, 10) < 1.0 && st.weight(16, 10) > 0.7);
        assert_eq!(st.weight(18, 10), 0.0);
        let c = Candidate {
            engine: Some(EngineLoad {
                running: 3,
                waiting: 2,
                kv_usage: 0.5,
            }),
            inflight_requests: 40,
            ..Candidate::default()
        };
        // The replica's own in-flight count does not enter.
        assert_eq!(scraped_load(&c), 5);
        assert_eq!(scraped_load(&Candidate::default()), 0);
    }
}
