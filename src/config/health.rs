//! `health_check:` (active probes) and `passive_health:` (ejection and retries).

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Active health checks: `GET path` on every instance every `interval`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckSettings {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "d_health_path")]
    pub path: String,
    #[serde(default = "d_health_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default = "d_health_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Consecutive successes that make an unhealthy instance healthy.
    #[serde(default = "d_rise")]
    pub rise: u32,
    /// Consecutive failures that make a healthy instance unhealthy.
    #[serde(default = "d_fall")]
    pub fall: u32,
}

impl Default for HealthCheckSettings {
    fn default() -> Self {
        HealthCheckSettings {
            enabled: true,
            path: d_health_path(),
            interval: d_health_interval(),
            timeout: d_health_timeout(),
            rise: d_rise(),
            fall: d_fall(),
        }
    }
}

/// Passive health: how the outcome of real requests acts on instances. `max_failures`
/// consecutive failed requests (connect failure, 5xx, timeout, died mid-response) eject an
/// instance for `eject_for` (0 disables ejection).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PassiveHealthSettings {
    #[serde(default = "d_max_failures")]
    pub max_failures: u32,
    #[serde(default = "d_eject_for", with = "humantime_serde")]
    pub eject_for: Duration,
    /// Engine statuses retried on another instance (never the same one twice, within the 3
    /// attempts a request has, body replayed exactly) when they arrive before any response
    /// byte reached the client. Default `[503, 429]`; `[]` passes every engine answer
    /// through. Retried 5xx count as failures for ejection; 429 (the engine is busy, not
    /// broken) does not. With no other instance left the engine's answer is passed through.
    #[serde(default = "d_retry_on_status")]
    pub retry_on_status: Vec<u16>,
}

impl Default for PassiveHealthSettings {
    fn default() -> Self {
        PassiveHealthSettings {
            max_failures: d_max_failures(),
            eject_for: d_eject_for(),
            retry_on_status: d_retry_on_status(),
        }
    }
}

fn d_health_path() -> String {
    "/health".into()
}
fn d_health_interval() -> Duration {
    Duration::from_secs(2)
}
fn d_health_timeout() -> Duration {
    Duration::from_secs(2)
}
fn d_rise() -> u32 {
    2
}
fn d_fall() -> u32 {
    3
}
fn d_max_failures() -> u32 {
    3
}
fn d_eject_for() -> Duration {
    Duration::from_secs(10)
}
fn d_retry_on_status() -> Vec<u16> {
    vec![503, 429]
}

impl HealthCheckSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let hc = self;
        if !hc.path.starts_with('/') {
            errs.push(format!(
                "health_check.path: {:?} must start with /",
                hc.path
            ));
        }
        if hc.interval.is_zero() || hc.timeout.is_zero() {
            errs.push("health_check.interval / timeout: must be greater than 0".into());
        }
        if hc.rise == 0 || hc.fall == 0 {
            errs.push("health_check.rise / fall: must be at least 1".into());
        }
    }
}

impl PassiveHealthSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        for (i, &code) in self.retry_on_status.iter().enumerate() {
            if !(code == 408 || code == 429 || (500..=599).contains(&code)) {
                errs.push(format!(
                "passive_health.retry_on_status[{i}]: {code} cannot be retried (expected 408, 429 or 5xx)"
            ));
            }
        }
    }
}

fn yes() -> bool {
    true
}
