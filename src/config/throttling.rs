//! `services[].throttling:`: slot limits and what happens beyond them.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Request throttling (see [`crate::throttle`]).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ThrottlingSettings {
    /// `reject` (429 at once) or `queue` (FIFO, up to `max_queue`, for `queue_timeout`).
    #[serde(default)]
    pub overflow: crate::throttle::Overflow,
    /// `instance` (each instance alone) or `service` (the combined load against the limit ×
    /// the number of instances).
    #[serde(default)]
    pub scope: crate::throttle::Scope,
    /// Requests from dispatch to completion per instance (integrated instances); 0 = none.
    #[serde(default)]
    pub total: u64,
    /// Requests from dispatch to their first token per instance; 0 = none.
    #[serde(default)]
    pub prefill: u64,
    /// Requests from their first token to completion per decode node of a prefill/decode
    /// disaggregated service; 0 = none.
    #[serde(default)]
    pub decode: u64,
    /// Queue mode: a longer queue rejects (429).
    #[serde(default = "d_max_queue")]
    pub max_queue: usize,
    /// Queue mode: a request that waited this long gets 503.
    #[serde(default = "d_queue_timeout", with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// `Retry-After` of a 429.
    #[serde(default = "d_retry_after", with = "humantime_serde")]
    pub retry_after: Duration,
}

fn d_max_queue() -> usize {
    1000
}
fn d_queue_timeout() -> Duration {
    Duration::from_secs(30)
}
fn d_retry_after() -> Duration {
    Duration::from_secs(1)
}

impl ThrottlingSettings {
    /// `has_pd`: the service is prefill/decode-disaggregated.
    pub(super) fn validate(&self, si: usize, has_pd: bool, errs: &mut Vec<String>) {
        let t = self;
        let p = format!("services[{si}].throttling");
        if t.decode > 0 && !has_pd {
            errs.push(format!(
            "{p}.decode: counts decode nodes of a prefill/decode-disaggregated service; services[{si}] has none (use prefill and total)"
        ));
        }
        if t.total > 0 && has_pd {
            errs.push(format!(
            "{p}.total: not counted in a prefill/decode-disaggregated service (use prefill for the prefill nodes and decode for the decode nodes)"
        ));
        }
        if t.prefill == 0 && t.total == 0 && t.decode == 0 {
            errs.push(format!(
                "{p}: set at least one limit (prefill, total or decode); 0 means no limit"
            ));
        }
        if t.overflow == crate::throttle::Overflow::Queue {
            if t.max_queue == 0 {
                errs.push(format!("{p}.max_queue: must be at least 1 in queue mode"));
            }
            if t.queue_timeout.is_zero() {
                errs.push(format!("{p}.queue_timeout: must be greater than 0"));
            }
        }
    }
}
