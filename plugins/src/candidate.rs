//! What every pipeline stage reads: the candidates (one per instance, with a snapshot of its
//! load), the per-request view, and [`Needs`], the inputs a stage declares so that the gateway
//! computes only those.

use std::ops::BitOr;

use crate::hash::{InstanceKey, SessionKey};
use crate::prefix::PrefixMatch;

/// An instance's part in a prefill/decode-disaggregated service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Role {
    /// An integrated engine: prefill and decode on the same instance.
    #[default]
    Integrated,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Integrated => "integrated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One instance as the scheduler sees it: an index into the caller's instance list and a
/// snapshot of its state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The caller's index of the instance.
    pub idx: usize,
    /// The instance's stable key (session table, prefix index). `InstanceKey::of(id)`.
    pub key: InstanceKey,
    /// Which route target (service) the instance belongs to, for pickers whose candidates
    /// span several targets. 0 when there is only one.
    pub target: u32,
    pub role: Role,
    /// Healthy and not ejected (see [`crate::filter::Available`]).
    pub available: bool,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    /// Dispatched requests that have not produced their first token yet (the prefill phase:
    /// queued in the engine or prefilling).
    pub waiting: u64,
    /// Uncached prompt tokens of those waiting requests (as estimated when each was
    /// dispatched): the prefill work queued on the instance by this gateway.
    pub prefill_tokens: u64,
    /// What the engine itself reports (its `/metrics`), when the gateway scrapes it.
    pub engine: Option<EngineLoad>,
    /// Every throttling slot of the instance is taken (instance-scope limits).
    pub full: bool,
    /// Blocks the gateway has placed on the instance
    /// ([`crate::prefix::PrefixIndex::placed_blocks`]): what its prefix index believes the
    /// instance holds, plus what the index forgot because it held more than the engine's
    /// cache size — how much distinct work went there (least-cached compares it).
    pub placed_blocks: u64,
}

/// An engine's own load figures, scraped from its Prometheus metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests in its running batch.
    pub running: u32,
    /// Requests queued in the engine (from every gateway and client).
    pub waiting: u32,
    /// Fraction of its KV cache in use (0..1).
    pub kv_usage: f64,
}

impl Default for Candidate {
    fn default() -> Self {
        Candidate {
            idx: 0,
            key: InstanceKey::default(),
            target: 0,
            role: Role::Integrated,
            available: true,
            inflight_requests: 0,
            inflight_tokens: 0,
            waiting: 0,
            prefill_tokens: 0,
            engine: None,
            full: false,
            placed_blocks: 0,
        }
    }
}

/// What a pipeline knows about one request. Cheap to build: all borrowed or `Copy`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestView<'a> {
    /// The session key the gateway chose from its key chain (`SessionKey::of(str)`).
    /// Computed only when the pipeline [`Needs::SESSION`].
    pub session: Option<SessionKey>,
    /// The prompt's chained block hashes ([`crate::hash::block_hashes`]).
    pub blocks: &'a [u64],
    /// The prompt matched against the prefix index of the candidates' service(s): how many
    /// leading blocks each instance holds. Computed when the pipeline [`Needs::PREFIX`] (the
    /// gateway also computes it to track the hit-rate ceiling).
    pub prefix: Option<&'a PrefixMatch>,
    /// The caller's clock, milliseconds.
    pub now_ms: u64,
    /// A per-scheduler request counter: drives round-robin and rotating tie-breaks.
    pub turn: u64,
    /// The decision service's answer: `Some(target)` (the candidates' `target` number) or
    /// `None` for abstain / not asked. Asked only when the pipeline [`Needs::DECISION`].
    pub decision: Option<u32>,
    /// Instances this request already tried (a retry): dropped by
    /// [`crate::filter::NotTried`].
    pub exclude: &'a [InstanceKey],
    /// Build the full per-candidate trace for [`crate::Decision::explain`] (debug logging).
    pub explain: bool,
    /// The prompt's estimated length in tokens.
    pub prompt_tokens: u64,
    /// Tokens per prefix block (the index's block size).
    pub block_tokens: u64,
}

impl RequestView<'_> {
    /// Matched leading blocks of `c` (0 without a prefix match).
    pub fn matched(&self, c: &Candidate) -> u32 {
        self.prefix.map_or(0, |m| m.matched(c.key))
    }

    /// The prompt tokens `c` would have to prefill: the prompt minus its cached prefix there.
    pub fn uncached_tokens(&self, c: &Candidate) -> u64 {
        self.prompt_tokens
            .saturating_sub(u64::from(self.matched(c)) * self.block_tokens)
    }

    /// Blocks in the prompt.
    pub fn prompt_blocks(&self) -> u32 {
        self.prefix
            .map_or(self.blocks.len() as u32, |m| m.prompt_blocks)
    }
}

/// The inputs a stage reads, beyond the candidates' load: the gateway computes the union of
/// what a pipeline's stages need, and nothing else.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Needs(u8);

impl Needs {
    pub const NONE: Needs = Needs(0);
    /// The session key ([`RequestView::session`]).
    pub const SESSION: Needs = Needs(1);
    /// The prefix match ([`RequestView::prefix`]).
    pub const PREFIX: Needs = Needs(2);
    /// The decision service's answer ([`RequestView::decision`]).
    pub const DECISION: Needs = Needs(4);
    /// Engine metrics scraped from the instances ([`Candidate::engine`]).
    pub const ENGINE: Needs = Needs(8);

    pub const fn union(self, o: Needs) -> Needs {
        Needs(self.0 | o.0)
    }

    pub const fn contains(self, o: Needs) -> bool {
        self.0 & o.0 == o.0 && o.0 != 0
    }

    /// The names of the inputs, for logs (`session+prefix`).
    pub fn names(self) -> String {
        let mut v = Vec::new();
        for (n, s) in [
            (Needs::SESSION, "session"),
            (Needs::PREFIX, "prefix"),
            (Needs::DECISION, "decision"),
            (Needs::ENGINE, "engine"),
        ] {
            if self.contains(n) {
                v.push(s);
            }
        }
        if v.is_empty() {
            "load".into()
        } else {
            v.join("+")
        }
    }
}

impl BitOr for Needs {
    type Output = Needs;
    fn bitor(self, o: Needs) -> Needs {
        self.union(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_union_and_names() {
        let n = Needs::SESSION | Needs::PREFIX;
        assert!(n.contains(Needs::SESSION) && n.contains(Needs::PREFIX));
        assert!(!n.contains(Needs::DECISION));
        assert!(!Needs::NONE.contains(Needs::NONE));
        assert_eq!(n.names(), "session+prefix");
        assert_eq!(Needs::NONE.names(), "load");
    }
}
