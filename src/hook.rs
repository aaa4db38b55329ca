//! Per-request hooks: a feature that follows a request from its plan to its end (the traffic
//! mirror's log line, [`crate::mirror`]) hands the request a [`Follower`] when it is planned
//! and is told how it ended; the request lifecycle ([`crate::request`]) holds no field of
//! its own for such a feature.

use crate::usage::Usage;
use std::time::Duration;

/// How a request ended, as its client saw it.
#[derive(Debug, Clone, Default)]
pub struct Ended {
    /// The instance (or remote upstream) that served it, `-` for none.
    pub instance: String,
    /// 0: no response was written.
    pub status: u16,
    /// Arrival to the first token.
    pub ttft: Option<Duration>,
    /// Arrival to the last byte.
    pub duration: Duration,
    pub usage: Usage,
}

/// A feature following one request, from its plan to its end.
pub trait Follower: Send + Sync {
    /// The request ended (called once; a follower dropped without it sees no end).
    fn on_complete(self: Box<Self>, ended: &Ended);
}
