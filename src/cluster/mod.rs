//! Several replicas that route as one (`cluster.redis`): what they share on Redis.
//!
//! * **Membership** — every `heartbeat` each replica scores itself in the `replicas` sorted
//!   set (Redis's clock); `/admin/cluster` lists the replicas with their age, healthy while
//!   seen within 3 heartbeats (dropped after 10).
//! * **Session bindings** — each dispatch of a request with a session key writes its
//!   binding (`s:<scheduler>:<session>` → instance id, with the session table's TTL); the
//!   routing path reads it back before picking (one `GET`, the only Redis round trip of an
//!   unthrottled request), so a session's turns stay on one instance whichever replica
//!   they reach.
//! * **Prefix placements** — each dispatch publishes the prompt's chained block hashes and
//!   the instance on the `events` channel; every other replica inserts them in its own
//!   index within a millisecond or so. The self-correcting trims travel the same way.
//! * **In-flight load and fair shares** — every `heartbeat / 10` a replica publishes its
//!   in-flight figures per instance and its throttling queues' figures per tenant (tokens
//!   granted, decayed; requests waiting) and reads the others', in one pipelined round trip
//!   ([`Cluster::sync`]); the scheduler compares instances on the fleet's sum, the queues
//!   order tenants by the fleet's service ([`crate::throttle`]).
//! * **Throttling slots as leases** — with `throttling` on a service, a slot of an instance
//!   is also a member of the instance's lease set (`lease:<service>:<instance>:<phase>`)
//!   taken by an atomic script only while the set holds fewer than the limit: a limit of N
//!   is N for the fleet. Leases carry an expiry that their replica renews every heartbeat;
//!   a replica that dies stops renewing and its slots come back after `cluster.lease`.
//!   A release is published so the other replicas' queues wake at once.
//!
//! Everything but the session read and the lease script is sent by one writer task, batched
//! in pipelines, off the request's path.
//!
//! **Redis down or slow**: a call that fails or takes longer than `cluster.redis.timeout`
//! turns the replica *degraded* (one warning, `tokengate_cluster_degraded` 1,
//! `/admin/instances` and the status page say so): requests route on local state (the
//! local limits still hold per replica) and make no Redis call at all; the heartbeat loop
//! probes Redis with a growing backoff and, when it answers, the replica is back (one
//! line in the log). A Redis restarted empty fills again from live traffic; each replica's
//! first heartbeat to it adds back the leases its running requests hold, and a replica that
//! sees the store's epoch change writes back its share of the last minute's charges to
//! each tenant's buckets (`Cluster::restore_usage`), so they do not start a fresh minute.

mod client;
mod leases;
mod metrics;
mod minute;
mod scripts;
mod sync;
mod tasks;
mod tenant;
pub mod wire;

pub use client::{settings_key, Cluster};
pub use leases::{Acquired, Lease};
pub use metrics::ClusterMetrics;
pub use sync::{FlowFigures, Synced};
pub use tasks::run;
pub use tenant::{TenantAdmission, TenantHold, TenantLimits};
pub use wire::{Event, Kind};
