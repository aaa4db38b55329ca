//! Picking a pair: a prefill instance and a decode instance for a prefill/decode-disaggregated
//! service, as two pipelines over the same candidates. The prefill pipeline filters to
//! [`Role::Prefill`] and runs the service's scheduler (affinity and prefix cache apply: the KV
//! cache lives on the prefill side); the decode pipeline filters to [`Role::Decode`] and
//! balances load.

use rand::RngCore;

use crate::candidate::{Candidate, Needs, RequestView};
use crate::decision::Decision;
use crate::pipeline::{Completion, Pipeline};

/// Two pipelines: the first chooses the prefill instance, the second the decode instance.
#[derive(Debug)]
pub struct PairPicker {
    pub prefill: Pipeline,
    pub decode: Pipeline,
}

impl PairPicker {
    pub fn needs(&self) -> Needs {
        self.prefill.needs() | self.decode.needs()
    }

    /// Both decisions (positions in `cands`), or `None` when either side has no candidate.
    pub fn pick(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<(Decision, Decision)> {
        let p = self.prefill.pick(req, cands, rng)?;
        let d = self.decode.pick(req, cands, rng)?;
        Some((p, d))
    }

    pub fn on_dispatch(&self, req: &RequestView<'_>, prefill: &Candidate, decode: &Candidate) {
        self.prefill.on_dispatch(req, prefill);
        self.decode.on_dispatch(req, decode);
    }

    pub fn on_complete(
        &self,
        req: &RequestView<'_>,
        prefill: &Candidate,
        decode: &Candidate,
        done: &Completion,
    ) {
        self.prefill.on_complete(req, prefill, done);
        self.decode.on_complete(req, decode, done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::LbPolicy;
    use crate::candidate::Role;
    use crate::filter::{Available, RoleIs};
    use crate::hash::InstanceKey;
    use crate::layered::{FirstHit, PrefixStage};
    use crate::prefix::PrefixIndex;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn a_prefill_decode_pair_is_two_composed_pipelines() {
        // p0, p1 prefill; d0, d1, d2 decode.
        let roles = [
            Role::Prefill,
            Role::Prefill,
            Role::Decode,
            Role::Decode,
            Role::Decode,
        ];
        let mut cs: Vec<Candidate> = roles
            .iter()
            .enumerate()
            .map(|(i, &role)| Candidate {
                idx: i,
                key: InstanceKey::of(&format!("n{i}")),
                role,
                ..Default::default()
            })
            .collect();
        let pair = PairPicker {
            prefill: Pipeline::new(
                FirstHit::balance(LbPolicy::LeastToken).then(PrefixStage::default()),
            )
            .filter(Available)
            .filter(RoleIs(Role::Prefill)),
            decode: Pipeline::new(FirstHit::balance(LbPolicy::LeastToken))
                .filter(Available)
                .filter(RoleIs(Role::Decode)),
        };
        assert_eq!(pair.needs(), Needs::PREFIX);
        // p1 holds the prompt, and is busier than p0: the prefix layer still picks it.
        let index = PrefixIndex::default();
        let prompt = [11u64, 12, 13, 14];
        index.insert(&prompt, cs[1].key, 0);
        cs[0].inflight_tokens = 100;
        cs[1].inflight_tokens = 120;
        // d0 is loaded, d1 unavailable: d2 decodes.
        cs[2].inflight_tokens = 500;
        cs[3].available = false;
        let m = index.match_prefix(&prompt, 0);
        let req = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            ..Default::default()
        };
        let (p, d) = pair.pick(&req, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
        assert_eq!((p.idx, p.reason.as_ref()), (1, "prefix(1.00)"));
        assert_eq!((d.idx, d.reason.as_ref()), (4, "least-token"));
        assert_eq!(d.dropped.len(), 3, "{d:?}"); // p0, p1 (role), d1 (unavailable)
                                                 // No decode node left: no pair.
        cs[2].available = false;
        cs[4].available = false;
        assert!(pair
            .pick(&req, &cs, &mut StdRng::seed_from_u64(0))
            .is_none());
    }
}
