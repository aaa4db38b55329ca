//! Filters: the first step of a pipeline ([`crate::pipeline::Filter`]).
//!
//! * [`Available`] — drops instances that are unhealthy or ejected (`unavailable`).
//! * [`NotTried`] — drops instances this request already tried (a retry) (`tried`).
//! * [`DecisionTarget`] — keeps only the route target the decision service named, when it
//!   named one that still has a candidate; otherwise keeps everything (it abstains)
//!   (`decision`).
//! * [`RoleIs`] — keeps the instances of one prefill/decode role (`role`).
//! * [`HasFreeSlot`] — drops instances whose throttling slots are all taken (`throttled`).

use crate::candidate::{Candidate, Needs, RequestView, Role};
use crate::pipeline::Filter;

/// Drops candidates that are not available (health checks failing, passively ejected).
#[derive(Clone, Copy, Debug, Default)]
pub struct Available;

impl Filter for Available {
    fn name(&self) -> &'static str {
        "unavailable"
    }
    fn apply(&self, _req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]) {
        for (k, c) in keep.iter_mut().zip(cands) {
            if !c.available {
                *k = false;
            }
        }
    }
}

/// Drops the instances in [`RequestView::exclude`]: a retry never goes back to an instance
/// that already failed this request.
#[derive(Clone, Copy, Debug, Default)]
pub struct NotTried;

impl Filter for NotTried {
    fn name(&self) -> &'static str {
        "tried"
    }
    fn apply(&self, req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]) {
        if req.exclude.is_empty() {
            return;
        }
        for (k, c) in keep.iter_mut().zip(cands) {
            if req.exclude.contains(&c.key) {
                *k = false;
            }
        }
    }
}

/// The decision service's answer restricts the choice to the target it named: the other
/// targets' instances are dropped. When it abstained (`decision` is `None`), or named a
/// target none of whose instances is left, every target stays.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecisionTarget;

impl Filter for DecisionTarget {
    fn name(&self) -> &'static str {
        "decision"
    }
    fn needs(&self) -> Needs {
        Needs::DECISION
    }
    fn apply(&self, req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]) {
        let Some(t) = req.decision else { return };
        let named_left = cands
            .iter()
            .zip(keep.iter())
            .any(|(c, k)| *k && c.target == t);
        if !named_left {
            return;
        }
        for (k, c) in keep.iter_mut().zip(cands) {
            if c.target != t {
                *k = false;
            }
        }
    }
}

/// Keeps only the instances of one role (prefill or decode nodes of a disaggregated service).
#[derive(Clone, Copy, Debug)]
pub struct RoleIs(pub Role);

impl Filter for RoleIs {
    fn name(&self) -> &'static str {
        "role"
    }
    fn apply(&self, _req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]) {
        for (k, c) in keep.iter_mut().zip(cands) {
            if c.role != self.0 {
                *k = false;
            }
        }
    }
}

/// Drops instances at their throttling limits ([`Candidate::full`]): with instance-scope
/// throttling only instances with a free slot are candidates.
#[derive(Clone, Copy, Debug, Default)]
pub struct HasFreeSlot;

impl Filter for HasFreeSlot {
    fn name(&self) -> &'static str {
        "throttled"
    }
    fn apply(&self, _req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]) {
        for (k, c) in keep.iter_mut().zip(cands) {
            if c.full {
                *k = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::InstanceKey;

    fn cands() -> Vec<Candidate> {
        (0..4)
            .map(|i| Candidate {
                idx: i,
                key: InstanceKey::of(&format!("i{i}")),
                target: (i / 2) as u32,
                ..Default::default()
            })
            .collect()
    }

    fn run(f: &dyn Filter, req: &RequestView<'_>, cs: &[Candidate]) -> Vec<bool> {
        let mut keep = vec![true; cs.len()];
        f.apply(req, cs, &mut keep);
        keep
    }

    #[test]
    fn available_and_not_tried() {
        let mut cs = cands();
        cs[1].available = false;
        assert_eq!(
            run(&Available, &RequestView::default(), &cs),
            [true, false, true, true]
        );
        let tried = [cs[2].key];
        let req = RequestView {
            exclude: &tried,
            ..Default::default()
        };
        assert_eq!(run(&NotTried, &req, &cs), [true, true, false, true]);
    }

    #[test]
    fn decision_keeps_the_named_target_or_abstains() {
        let cs = cands();
        let named = |t| RequestView {
            decision: Some(t),
            ..Default::default()
        };
        assert_eq!(
            run(&DecisionTarget, &named(1), &cs),
            [false, false, true, true]
        );
        assert_eq!(
            run(&DecisionTarget, &RequestView::default(), &cs),
            [true; 4]
        );
        // A target with no candidate left: abstain rather than leave nothing.
        assert_eq!(run(&DecisionTarget, &named(7), &cs), [true; 4]);
        let mut keep = vec![true, true, false, false];
        DecisionTarget.apply(&named(1), &cs, &mut keep);
        assert_eq!(keep, [true, true, false, false]);
    }

    #[test]
    fn full_instances_are_not_candidates() {
        let mut cs = cands();
        cs[2].full = true;
        assert_eq!(
            run(&HasFreeSlot, &RequestView::default(), &cs),
            [true, true, false, true]
        );
    }

    #[test]
    fn role_filter() {
        let mut cs = cands();
        cs[0].role = Role::Prefill;
        cs[3].role = Role::Decode;
        assert_eq!(
            run(&RoleIs(Role::Decode), &RequestView::default(), &cs),
            [false, false, false, true]
        );
    }
}
