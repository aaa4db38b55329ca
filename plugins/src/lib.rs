//! tokengate-plugins: the routing brain of tokengate.
//!
//! Everything in this crate is pure and synchronous: no Pingora, no sockets, no clocks
//! except where a caller passes one in (`now_ms`). The gateway (`src/`) snapshots its load
//! table into [`Candidate`]s and asks a picker which one wins and why.
//!
//! * [`balance`] — least-token / least-request / round-robin (the last layer of every pick).
//! * [`hash`] — instance / session keys, chained prompt block hashes.
//! * [`session`] — the session table (affinity state).
//! * [`prefix`] — the prefix index (which instance holds which prompt prefix).
//! * [`scorer`] — the per-request view, the `Scorer` trait and the built-in scorers.
//! * [`layered`] — layered mode: affinity → prefix → balance.
//! * [`policy`] — policy mode: Σ weight × normalised score.
//! * [`route`] — splitting a route's traffic between its targets.
//! * [`decision`] — the decision record and its one-line explanation.

pub mod balance;
pub mod decision;
pub mod hash;
pub mod layered;
pub mod policy;
pub mod prefix;
pub mod route;
pub mod scorer;
pub mod session;

pub use balance::{pick, Candidate, LbPolicy, Pick};
pub use decision::{AffinityOutcome, Decision, Layer, Trace};
pub use hash::{block_hashes, block_hashes_into, InstanceKey, SessionKey};
pub use layered::{AffinityConfig, AffinityMode, LayeredConfig, LayeredPicker, PrefixLayerConfig};
pub use policy::{PluginConfig, PluginKind, PolicyConfig, PolicyError, PolicyPicker};
pub use prefix::{IndexGauges, PrefixIndex, PrefixIndexConfig, PrefixMatch};
pub use route::{round_robin_flat, WeightedTargets};
pub use scorer::{RequestView, Scorer};
pub use session::{SessionConfig, SessionGauges, SessionTable};

/// Re-exported so the gateway can hand [`PolicyPicker::decide`] an RNG of the same version
/// (e.g. `rand::rngs::SmallRng` per worker thread) without a dependency of its own.
pub use rand;
