//! `timeouts:`: upstream and client-body timeouts.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Upstream timeouts (humantime strings: `500ms`, `2s`, `10m`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to an engine.
    #[serde(default = "d_connect", with = "humantime_serde")]
    pub connect: Duration,
    /// From the request being sent to the response header (prefill + queueing).
    #[serde(default = "d_first_byte", with = "humantime_serde")]
    pub first_byte: Duration,
    /// Longest silence between two response chunks once the response has started.
    #[serde(default = "d_idle", with = "humantime_serde")]
    pub idle: Duration,
    /// Whole request, checked at every response chunk.
    #[serde(default = "d_total", with = "humantime_serde")]
    pub total: Duration,
    /// Longest time to receive a client's whole request body (and longest silence between
    /// two of its reads); a slower upload is answered 408 and the connection closed.
    #[serde(default = "d_client_body", with = "humantime_serde")]
    pub client_body: Duration,
    /// Longest time from a request's first byte to the end of its head (request line and
    /// headers); a slower client (slowloris) is answered 408 and the connection closed.
    #[serde(default = "d_client_head", with = "humantime_serde")]
    pub client_head: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: d_connect(),
            first_byte: d_first_byte(),
            idle: d_idle(),
            total: d_total(),
            client_body: d_client_body(),
            client_head: d_client_head(),
        }
    }
}

fn d_connect() -> Duration {
    Duration::from_secs(3)
}
fn d_first_byte() -> Duration {
    Duration::from_secs(120)
}
fn d_idle() -> Duration {
    Duration::from_secs(60)
}
fn d_total() -> Duration {
    Duration::from_secs(1800)
}
fn d_client_body() -> Duration {
    Duration::from_secs(60)
}
fn d_client_head() -> Duration {
    Duration::from_secs(10)
}

impl Timeouts {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let t = self;
        for (name, d) in [
            ("connect", t.connect),
            ("first_byte", t.first_byte),
            ("idle", t.idle),
            ("total", t.total),
            ("client_body", t.client_body),
            ("client_head", t.client_head),
        ] {
            if d.is_zero() {
                errs.push(format!("timeouts.{name}: must be greater than 0"));
            }
        }
    }
}
