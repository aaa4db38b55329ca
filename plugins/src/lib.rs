//! tokengate-plugins: the routing brain of tokengate.
//!
//! Everything in this crate is pure and synchronous: no Pingora, no sockets, no clocks
//! except where a caller passes one in (`now_ms`), no RNG except the one passed in. The
//! gateway (`src/`) snapshots its load table into [`Candidate`]s and runs a [`Pipeline`]:
//! filters drop candidates, a picker chooses one and says why ([`Decision`]).
//!
//! * [`candidate`] — the candidates, the per-request view, [`Needs`] (the inputs a stage reads).
//! * [`pipeline`] — the [`Filter`] and [`Picker`] traits and the [`Pipeline`] that runs them.
//! * [`filter`] — availability, tried instances, the decision service's target, a role.
//! * [`layered`] — layered mode: first-hit stages (affinity → prefix) then load balancing.
//! * [`balance`] — least-token / least-request / round-robin / predicted-ttft (the last layer).
//! * [`cost`] — the predicted time to first token and the rates it learns.
//! * [`policy`] — policy mode: Σ weight × normalised score of [`scorer`]s.
//! * [`scorer`] — the [`Scorer`] trait and the policy plugins, one file each (parameters,
//!   checks, logic), listed in its registry ([`PluginSettings`]).
//! * [`pair`] — a prefill + decode pair from two pipelines.
//! * [`hash`] — instance / session keys, chained prompt block hashes.
//! * [`session`] — the session table (affinity state).
//! * [`prefix`] — the prefix index (which instance holds which prompt prefix).
//! * [`calibrate`] — the index's prediction in an engine's units (its block size, its tokenizer).
//! * [`route`] — splitting a route's traffic between its targets.
//! * [`decision`] — the decision record and its one-line explanation.

pub mod balance;
pub mod calibrate;
pub mod candidate;
pub mod cost;
pub mod decision;
pub mod filter;
pub mod hash;
pub mod layered;
pub mod pair;
pub mod pipeline;
pub mod policy;
pub mod prefix;
pub mod route;
pub mod scorer;
pub mod session;

pub use balance::{pick, LbPolicy, Pick};
pub use candidate::{Candidate, EngineLoad, Needs, RequestView, Role};
pub use cost::{warm, CostConfig, CostModel, Estimate, Follow, Learned, Observation, RateFrom};
pub use decision::{AffinityOutcome, Decision, Dropped, Layer, Trace};
pub use filter::{Available, DecisionTarget, HasFreeSlot, NotTried, RoleIs};
pub use hash::{block_hashes, block_hashes_into, InstanceKey, SessionKey};
pub use layered::{
    Adaptive, AffinityMode, AffinityStage, CostTolerance, Eligibility, Escape, FirstHit,
    LeastCachedStage, PrefixLayerConfig, PrefixStage, RendezvousStage, Stage, PREFIX_SPILL,
    RENDEZVOUS_PREFIX, RENDEZVOUS_SESSION,
};
pub use pair::PairPicker;
pub use pipeline::{Completion, Filter, Outcome, Picker, Pipeline};
pub use policy::{PolicyError, WeightedSum};
pub use prefix::{IndexGauges, PrefixIndex, PrefixIndexConfig, PrefixMatch};
pub use route::WeightedTargets;
pub use scorer::{
    BuildCtx, DecisionServiceParams, LeastCachedParams, LeastCachedScorer, LeastInflightParams,
    LeastInflightScorer, LeastTokenParams, LeastTokenScorer, Plugin, PluginParams, PluginSettings,
    PredictedTtftParams, PredictedTtftScorer, PrefixCacheParams, PrefixScorer, Scorer,
    SessionAffinityParams, SessionAffinityScorer, UnboundSessions,
};
pub use session::{SessionConfig, SessionGauges, SessionTable};

/// Re-exported so the gateway can hand [`Pipeline::pick`] an RNG of the same version
/// (e.g. `rand::rngs::SmallRng` per worker thread) without a dependency of its own.
pub use rand;
