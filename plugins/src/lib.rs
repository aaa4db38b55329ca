//! tokengate-plugins: the routing brain of tokengate.
//!
//! Everything in this crate is pure and synchronous: no Pingora, no sockets, no clocks
//! except where a caller passes one in. The gateway (`src/`) snapshots its load table into
//! [`Candidate`]s and asks a picker which one wins and why.

pub mod balance;

pub use balance::{pick, Candidate, LbPolicy, Pick};
