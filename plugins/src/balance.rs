//! Load balancing: the last layer of every scheduling decision.
//!
//! * `least-token`: the candidate with the fewest in-flight tokens (prompt estimate +
//!   expected output of every request dispatched and not yet finished). Tokens, not requests,
//!   are what an engine's batch is made of: one 30k-token prompt weighs more than ten chats.
//! * `least-request`: the candidate with the fewest in-flight requests.
//! * `round-robin`: each candidate in turn.
//! * `predicted-ttft`: the candidate with the lowest predicted time to first token
//!   ([`crate::cost`]: queued prefill work, this request's uncached tokens there, the learned
//!   prefill rate); chosen by [`crate::layered::FirstHit`], which has the estimates. Without
//!   estimates (this function alone) it balances like `least-token`.
//!
//! Ties are broken by a rotating offset (the caller's request counter), so an idle fleet
//! is filled evenly instead of always starting at the first instance.

use std::fmt;

use crate::candidate::Candidate;

/// A load-balancing policy, as named in the YAML config (`least-token`, `least-request`,
/// `round-robin`, `predicted-ttft`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LbPolicy {
    #[default]
    LeastToken,
    LeastRequest,
    RoundRobin,
    PredictedTtft,
}

impl LbPolicy {
    /// The config / header name of the policy.
    pub fn as_str(self) -> &'static str {
        match self {
            LbPolicy::LeastToken => "least-token",
            LbPolicy::LeastRequest => "least-request",
            LbPolicy::RoundRobin => "round-robin",
            LbPolicy::PredictedTtft => "predicted-ttft",
        }
    }

    /// The load figure this policy balances on (also used by session affinity's
    /// "is my instance overloaded" check).
    pub fn load_of(self, c: &Candidate) -> u64 {
        match self {
            LbPolicy::LeastToken | LbPolicy::PredictedTtft => c.inflight_tokens,
            LbPolicy::LeastRequest | LbPolicy::RoundRobin => c.inflight_requests,
        }
    }
}

impl fmt::Display for LbPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of a pick: which candidate (the position in the slice) and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    pub pos: usize,
    pub reason: LbPolicy,
}

/// Picks one of `cands` by `policy`. `turn` is a monotonically increasing counter supplied by
/// the caller (one per request): it drives round-robin and rotates tie-breaking.
/// Returns `None` only when `cands` is empty.
pub fn pick(policy: LbPolicy, cands: &[Candidate], turn: u64) -> Option<Pick> {
    let n = cands.len();
    if n == 0 {
        return None;
    }
    let start = (turn % n as u64) as usize;
    let pos = match policy {
        LbPolicy::RoundRobin => start,
        LbPolicy::LeastToken | LbPolicy::LeastRequest | LbPolicy::PredictedTtft => {
            let mut best = start;
            let mut best_key = key(policy, &cands[start]);
            for step in 1..n {
                let i = (start + step) % n;
                let k = key(policy, &cands[i]);
                if k < best_key {
                    best = i;
                    best_key = k;
                }
            }
            best
        }
    };
    Some(Pick {
        pos,
        reason: policy,
    })
}

/// Primary figure, then the other one as a tie-breaker.
fn key(policy: LbPolicy, c: &Candidate) -> (u64, u64) {
    match policy {
        LbPolicy::LeastToken | LbPolicy::PredictedTtft => (c.inflight_tokens, c.inflight_requests),
        _ => (c.inflight_requests, c.inflight_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(idx: usize, req: u64, tok: u64) -> Candidate {
        Candidate {
            idx,
            inflight_requests: req,
            inflight_tokens: tok,
            waiting: 0,
            ..Default::default()
        }
    }

    #[test]
    fn empty_is_none() {
        assert_eq!(pick(LbPolicy::LeastToken, &[], 0), None);
    }

    #[test]
    fn least_token_prefers_fewest_tokens_over_fewest_requests() {
        let cands = [c(0, 1, 30_000), c(1, 5, 500), c(2, 2, 9_000)];
        for turn in 0..6 {
            assert_eq!(pick(LbPolicy::LeastToken, &cands, turn).unwrap().pos, 1);
            assert_eq!(pick(LbPolicy::LeastRequest, &cands, turn).unwrap().pos, 0);
        }
    }

    #[test]
    fn ties_rotate_so_an_idle_fleet_fills_evenly() {
        let cands = [c(0, 0, 0), c(1, 0, 0), c(2, 0, 0)];
        let picks: Vec<usize> = (0..6)
            .map(|t| pick(LbPolicy::LeastRequest, &cands, t).unwrap().pos)
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn round_robin_cycles_whatever_the_load() {
        let cands = [c(0, 9, 9), c(1, 0, 0)];
        let picks: Vec<usize> = (0..4)
            .map(|t| pick(LbPolicy::RoundRobin, &cands, t).unwrap().pos)
            .collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
    }

    #[test]
    fn policy_names_are_the_config_names() {
        for p in [
            LbPolicy::LeastToken,
            LbPolicy::LeastRequest,
            LbPolicy::RoundRobin,
            LbPolicy::PredictedTtft,
        ] {
            let v: LbPolicy =
                serde::de::Deserialize::deserialize(serde::de::value::StrDeserializer::<
                    serde::de::value::Error,
                >::new(p.as_str()))
                .unwrap();
            assert_eq!(v, p);
        }
    }
}
