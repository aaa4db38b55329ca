//! `cluster:`: several gateway replicas that route as one, their shared state on Redis
//! ([`crate::cluster`]), or, without Redis, agreeing where a new session or prefix goes by
//! rendezvous hashing (`placement: rendezvous`). Absent: a single replica, nothing shared,
//! no Redis.

use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    /// The shared store. Absent: the replicas share nothing (`placement: rendezvous` is then
    /// required: what they can agree on without talking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisSettings>,
    /// Where the layered scheduler puts a new session or a prefix cached nowhere: `load` (the
    /// scheduler's own layers: least-cached, then balancing — with Redis on the fleet's
    /// load) or `rendezvous` (a weighted rendezvous hash of the session or first block over
    /// the engines' scraped load, the same on every replica). Default: `load` with `redis`;
    /// without it, `rendezvous` must be set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// This replica's name in `/admin/cluster` (default: host name, process id and a random
    /// suffix; two replicas must not share one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// How often a replica renews its registration and its slot leases.
    #[serde(default = "d_heartbeat", with = "humantime_serde")]
    pub heartbeat: Duration,
    /// How long a throttling slot stays taken without a renewal: a replica that dies gives
    /// its slots back after this long (and leaves `/admin/cluster` after 3 heartbeats).
    #[serde(default = "d_lease", with = "humantime_serde")]
    pub lease: Duration,
}

/// `cluster.placement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// The layered scheduler's own layers (least-cached, then balancing).
    Load,
    /// Weighted rendezvous hashing over the engines' scraped load
    /// ([`tokengate_plugins::RendezvousStage`]).
    Rendezvous,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSettings {
    /// `redis://[user:password@]host:port[/db]` (or `rediss://` for TLS).
    #[serde(serialize_with = "mask_url")]
    pub url: String,
    /// Prefix of every key and channel (several fleets on one Redis).
    #[serde(default = "d_prefix")]
    pub key_prefix: String,
    /// Longest wait for Redis on a request's path; past it the request routes on local
    /// state and the replica counts itself degraded until Redis answers again.
    #[serde(default = "d_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn d_heartbeat() -> Duration {
    Duration::from_secs(1)
}
fn d_lease() -> Duration {
    Duration::from_secs(10)
}
fn d_prefix() -> String {
    "tokengate".into()
}
fn d_timeout() -> Duration {
    Duration::from_millis(50)
}

/// `redis://user:***@host` for logs and `check --print`.
pub fn masked_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

fn mask_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&masked_url(url))
}

impl ClusterSettings {
    /// Whether new sessions and prefixes are placed by rendezvous hashing.
    pub fn rendezvous(&self) -> bool {
        self.placement == Some(Placement::Rendezvous)
    }

    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        let Some(r) = &self.redis else {
            if !self.rendezvous() {
                errs.push(
                    "cluster.placement: without cluster.redis the replicas share nothing; set `placement: rendezvous` (replicas agree where new sessions and prefixes go) or give `redis: {url}`"
                        .into(),
                );
            }
            return;
        };
        if !(r.url.starts_with("redis://") || r.url.starts_with("rediss://")) {
            errs.push(format!(
                "cluster.redis.url: {:?} is not a Redis URL (expected redis://host:port, or rediss:// for TLS)",
                masked_url(&r.url)
            ));
        } else if let Err(e) = redis::Client::open(r.url.as_str()) {
            errs.push(format!(
                "cluster.redis.url: {:?} is not a valid Redis URL: {e}",
                masked_url(&r.url)
            ));
        }
        if r.key_prefix.is_empty() || r.key_prefix.chars().any(|c| c.is_whitespace()) {
            errs.push(
                "cluster.redis.key_prefix: must be non-empty and contain no whitespace".into(),
            );
        }
        if r.timeout.is_zero() || r.timeout > Duration::from_secs(5) {
            errs.push(format!(
                "cluster.redis.timeout: {} is outside 1ms..5s (a request waits at most this long for Redis)",
                humantime::format_duration(r.timeout)
            ));
        }
        if self.heartbeat < Duration::from_millis(100) || self.heartbeat > Duration::from_secs(60) {
            errs.push(format!(
                "cluster.heartbeat: {} is outside 100ms..60s",
                humantime::format_duration(self.heartbeat)
            ));
        }
        if self.lease < self.heartbeat * 3 {
            errs.push(format!(
                "cluster.lease: {} must be at least 3 heartbeats ({}): a live replica renews its leases every heartbeat",
                humantime::format_duration(self.lease),
                humantime::format_duration(self.heartbeat * 3)
            ));
        }
        if let Some(n) = &self.replica {
            if n.is_empty() || n.len() > 100 || n.chars().any(|c| c.is_whitespace()) {
                errs.push("cluster.replica: must be 1 to 100 characters without whitespace".into());
            }
        }
    }
}
