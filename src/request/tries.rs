//! What a request's attempts so far leave behind (its [`State`] in `Ctx`), and the words the
//! attempt state machine ([`super::attempt`]) decides in: how an attempt failed, where the next
//! one goes. Plain data with no use of the request phases, so `Ctx` can hold it without a
//! module cycle.

use bytes::Bytes;
use tokengate_plugins::InstanceKey;

/// A request's attempts so far (part of its `Ctx`).
#[derive(Default)]
pub struct State {
    /// Attempts dispatched.
    pub count: usize,
    /// Our instances not to try again (tried, or blamed for a failed attempt).
    pub tried: Vec<InstanceKey>,
    /// Member gateways (global scheduling) or split-proxy entries already tried.
    pub tried_remote: Vec<String>,
    /// Where the next attempt goes, decided when the current one failed.
    pub next: Option<Next>,
    /// The current attempt's body when its leg rewrites the planned one (the model name, a
    /// disaggregated pair's fields).
    pub sent: Option<Bytes>,
}

/// How an attempt failed (always before any response byte reached the client).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The connection could not be made.
    Connect,
    /// The upstream answered this status.
    Status(u16),
    /// The connection was closed or reset before the answer.
    Reset,
    /// Nothing arrived within the timeouts.
    Timeout,
    /// A disaggregated pair's prefill failed with a retryable error.
    Prefill,
    /// Any other error before the answer.
    Other,
}

/// Where the next attempt goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Another instance of the plan's destination.
    Local,
    /// The next split-proxy entry that takes part in failover.
    Entry,
    /// The next member gateway.
    Member,
}
