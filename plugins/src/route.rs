//! Route target selection: how a route splits its traffic between its targets (services).
//!
//! * **weights** ([`WeightedTargets`]): a target's weight is its share of the route's
//!   traffic, whatever its instance count — A(100, 1 instance) and B(100, 2 instances) split
//!   50/50 and each B instance gets 25 %. Targets are chosen by nginx's smooth weighted
//!   round-robin (deterministic, and it interleaves: weights 1:3 give `B A B B`, not
//!   `A B B B`); the service's load balancer then picks inside the target. Give each target
//!   its own `turn` counter for that inner pick: a shared counter advancing in step with the
//!   target sequence could always land on the same instance.
//! * **round-robin**: the targets in turn (equal weights), whatever their instance counts; the
//!   target's own scheduler then picks the instance.
//!
//! Targets without available instances are skipped (their weight is redistributed).

use parking_lot::Mutex;

/// Smooth weighted round-robin over a route's targets.
#[derive(Debug)]
pub struct WeightedTargets {
    weights: Vec<u32>,
    current: Mutex<Vec<i64>>,
}

impl WeightedTargets {
    /// `weights[t]` is target `t`'s weight; 0 means never chosen.
    pub fn new(weights: &[u32]) -> Self {
        WeightedTargets {
            weights: weights.to_vec(),
            current: Mutex::new(vec![0; weights.len()]),
        }
    }

    pub fn weights(&self) -> &[u32] {
        &self.weights
    }

    /// The next target among those with `available(t)` (e.g. at least one healthy,
    /// untried instance). `None` when no available target has a positive weight.
    pub fn pick(&self, available: impl Fn(usize) -> bool) -> Option<usize> {
        let mut cur = self.current.lock();
        let mut total = 0i64;
        let mut best: Option<usize> = None;
        for (t, &w) in self.weights.iter().enumerate() {
            if w == 0 || !available(t) {
                continue;
            }
            let w = i64::from(w);
            cur[t] += w;
            total += w;
            if best.is_none_or(|b| cur[t] > cur[b]) {
                best = Some(t);
            }
        }
        let b = best?;
        cur[b] -= total;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::{pick, LbPolicy};
    use crate::candidate::Candidate;

    /// Picks `n` times: a target by weight, then an instance by least-request inside it
    /// (idle instances, so the rotating tie-break spreads them), with per-target turns.
    fn shares(weights: &[u32], instances: &[usize], n: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
        let wt = WeightedTargets::new(weights);
        let mut turns = vec![0u64; weights.len()];
        let mut per_target = vec![0usize; weights.len()];
        let mut per_inst: Vec<Vec<usize>> = instances.iter().map(|&c| vec![0; c]).collect();
        for _ in 0..n {
            let t = wt.pick(|_| true).unwrap();
            let cands: Vec<Candidate> = (0..instances[t])
                .map(|i| Candidate {
                    idx: i,
                    ..Default::default()
                })
                .collect();
            let p = pick(LbPolicy::LeastRequest, &cands, turns[t]).unwrap();
            turns[t] += 1;
            per_target[t] += 1;
            per_inst[t][cands[p.pos].idx] += 1;
        }
        let f = |x: usize| x as f64 / n as f64;
        (
            per_target.into_iter().map(f).collect(),
            per_inst
                .into_iter()
                .map(|v| v.into_iter().map(f).collect())
                .collect(),
        )
    }

    fn near(a: f64, b: f64) -> bool {
        (a - b).abs() <= 0.03
    }

    #[test]
    fn equal_weights_split_evenly_whatever_the_instance_counts() {
        let (t, i) = shares(&[100, 100], &[1, 2], 10_000);
        assert!(near(t[0], 0.5) && near(t[1], 0.5), "{t:?}");
        assert!(near(i[0][0], 0.5), "{i:?}");
        assert!(near(i[1][0], 0.25) && near(i[1][1], 0.25), "{i:?}");
    }

    #[test]
    fn weights_100_300_split_25_75() {
        let (t, _) = shares(&[100, 300], &[1, 1], 10_000);
        assert!(near(t[0], 0.25) && near(t[1], 0.75), "{t:?}");
    }

    #[test]
    fn scaling_a_target_does_not_change_its_share() {
        let (one, _) = shares(&[100, 300], &[1, 1], 10_000);
        let (two, inst) = shares(&[100, 300], &[2, 1], 10_000);
        assert_eq!(one, two); // deterministic: exactly the same split
        assert!(
            near(inst[0][0], 0.125) && near(inst[0][1], 0.125),
            "{inst:?}"
        );
    }

    #[test]
    fn smooth_interleaving_and_skipping() {
        let wt = WeightedTargets::new(&[1, 3]);
        let seq: Vec<usize> = (0..8).map(|_| wt.pick(|_| true).unwrap()).collect();
        assert_eq!(seq, vec![1, 0, 1, 1, 1, 0, 1, 1]);
        // Target 1 unavailable: everything to 0; nothing available: None.
        let wt = WeightedTargets::new(&[1, 3, 0]);
        assert!((0..5).all(|_| wt.pick(|t| t != 1) == Some(0)));
        assert_eq!(wt.pick(|t| t == 2), None);
        assert_eq!(WeightedTargets::new(&[]).pick(|_| true), None);
    }
}
