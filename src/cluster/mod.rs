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
//! * **In-flight load** — every `heartbeat / 10` a replica publishes its in-flight figures per
//!   instance and reads the others' ([`Cluster::sync_load`]); the scheduler compares instances
//!   on the fleet's sum.
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
//! first heartbeat to it adds back the leases its running requests hold (and a tenant's
//! per-minute buckets start full).

pub mod wire;

use crate::config::{masked_url, ClusterSettings};
use log::{info, warn};
use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokengate_plugins::SessionKey;
use tokio::sync::mpsc;
pub use wire::{Event, Kind};

/// Not connected yet (the first heartbeat has not answered).
const CONNECTING: u8 = 0;
const OK: u8 = 1;
const DEGRADED: u8 = 2;

/// Most writes waiting for the writer; beyond it a write is dropped and counted (Redis is
/// slower than the traffic: the replica routes on local state for those).
const OUTBOX: usize = 16_384;

/// Takes a slot: drops the expired leases, then adds this one if fewer than the limit
/// remain. KEYS[1] the lease set; ARGV limit, member, lease ms. Redis's own clock.
const ACQUIRE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
  return 1
end
return 0
";

/// The heartbeat: the replica's score in the replica set, the departed dropped, and the
/// renewal of its live leases (KEYS[2..] their sets, ARGV[4..] their members).
/// KEYS[1] the replica set; ARGV replica id, lease ms, forget-after ms. A lease is renewed
/// only while it is there (a lease released meanwhile is not brought back), except when the
/// replica itself was not registered: Redis lost its data (restarted empty) or forgot the
/// replica, and its live leases are added again, so the fleet counts the requests that still
/// hold them (one released while the heartbeat was under way is removed again after it).
/// Returns 1 when it re-registered, else 0.
const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fresh = redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
local ttl = tonumber(ARGV[2])
for i = 2, #KEYS do
  if fresh == 1 then
    redis.call('ZADD', KEYS[i], now + ttl, ARGV[i + 2])
  else
    redis.call('ZADD', KEYS[i], 'XX', now + ttl, ARGV[i + 2])
  end
  redis.call('PEXPIRE', KEYS[i], ttl * 2)
end
return fresh
";

/// The replica set with Redis's time: `{now, id, score, id, score, ...}`.
const MEMBERS: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
table.insert(r, 1, tostring(now))
return r
";

/// Publishes this replica's in-flight figures per instance (ARGV[4..]: instance, "r,t,w,p")
/// and returns every other registered replica's, flat. KEYS[1] the replica set; ARGV key
/// prefix, replica id, ms to keep them.
const LOAD_SYNC: &str = r"
local own = ARGV[1] .. ':load:' .. ARGV[2]
redis.call('DEL', own)
if #ARGV > 3 then
  local args = {}
  for i = 4, #ARGV do args[#args + 1] = ARGV[i] end
  redis.call('HSET', own, unpack(args))
  redis.call('PEXPIRE', own, tonumber(ARGV[3]))
end
local out = {}
for _, r in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if r ~= ARGV[2] then
    local h = redis.call('HGETALL', ARGV[1] .. ':load:' .. r)
    for i = 1, #h do out[#out + 1] = h[i] end
  end
end
return out
";

/// A tenant's fleet-wide limits: its per-minute buckets in one hash (`tenant:<name>`:
/// fields `r`, `i`, `o` the levels of requests, input and output tokens, `at` when they were
/// last refilled, by Redis's clock) refilled and taken like the local ones
/// ([`crate::tenants`]), and its requests in flight as leases (`tenant:<name>:inflight`)
/// like the throttling slots. KEYS[1] the hash, KEYS[2] the lease set, KEYS[3] (optional) a
/// session binding read in the same round trip; ARGV the three per-minute limits (0: none),
/// the concurrency limit (0: none), the input and output tokens to reserve, the lease
/// member and the lease ms. Returns {admitted 1/0, the limit refusing (1 requests, 2 input,
/// 3 output, 4 concurrency), ms until it would admit, the session's binding or nil, and
/// for each per-minute limit what remains after this request (-1: no such limit, or
/// refused)}.
const TENANT_ADMIT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local session = false
if #KEYS >= 3 then session = redis.call('GET', KEYS[3]) end
local conc = tonumber(ARGV[4])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= conc then return {0, 4, 1000, session, -1, -1, -1} end
end
local h = redis.call('HMGET', KEYS[1], 'r', 'i', 'o', 'at')
local dt = math.max(now - (tonumber(h[4]) or now), 0)
local needs = {1, tonumber(ARGV[5]), tonumber(ARGV[6])}
local levels = {}
local any = false
for k = 1, 3 do
  local limit = tonumber(ARGV[k])
  if limit > 0 then
    any = true
    local l = math.min((tonumber(h[k]) or limit) + dt * limit / 60000, limit)
    local need = math.min(needs[k], limit)
    if l < need then
      return {0, k, math.ceil((need - l) * 60000 / limit), session, -1, -1, -1}
    end
    levels[k] = l - needs[k]
  end
end
if any then
  local f = {'r', 'i', 'o'}
  for k = 1, 3 do
    if levels[k] then redis.call('HSET', KEYS[1], f[k], tostring(levels[k])) end
  end
  redis.call('HSET', KEYS[1], 'at', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
if conc > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[8]), ARGV[7])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[8]) * 2)
end
local left = {-1, -1, -1}
for k = 1, 3 do
  if levels[k] then left[k] = math.max(0, math.floor(levels[k])) end
end
return {1, 0, 0, session, left[1], left[2], left[3]}
";

/// Settles a tenant's request in its fleet-wide buckets: gives back what was reserved and
/// not used (`ARGV[4..6]` per bucket, negative: used more than reserved), after refilling
/// all three to now. KEYS[1] the hash; ARGV[1..3] the per-minute limits (0: none).
const TENANT_SETTLE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'r', 'i', 'o', 'at')
local dt = math.max(now - (tonumber(h[4]) or now), 0)
local f = {'r', 'i', 'o'}
for k = 1, 3 do
  local limit = tonumber(ARGV[k])
  if limit > 0 then
    local l = math.min((tonumber(h[k]) or limit) + dt * limit / 60000, limit)
    l = math.min(l + tonumber(ARGV[k + 3]), limit)
    redis.call('HSET', KEYS[1], f[k], tostring(l))
  end
end
redis.call('HSET', KEYS[1], 'at', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return 1
";

/// A tenant's limits as the fleet-wide script takes them (0: no such limit).
#[derive(Debug, Clone, Copy, Default)]
pub struct TenantLimits {
    pub per_minute: [u64; 3],
    pub concurrency: u64,
}

/// The answer of [`Cluster::admit_tenant`].
pub enum TenantAdmission {
    /// Admitted fleet-wide: its concurrency lease (when the tenant has that limit), and the
    /// session binding read along (when one was asked for).
    Admitted {
        hold: TenantHold,
        session: Option<String>,
    },
    /// Refused: which limit (1 requests, 2 input, 3 output, 4 concurrency), and when to
    /// retry.
    Refused { limit: u8, retry_after: Duration },
    /// Redis did not answer: the local limits alone decide (per replica).
    Unknown,
}

/// A request's hold on its tenant's fleet-wide limits: its concurrency lease (given back
/// when dropped or [`TenantHold::release`]d) and the settlement of its tokens.
pub struct TenantHold {
    /// What the fleet's buckets held after this request (requests, input, output; `None`:
    /// no such limit), for its `x-ratelimit-remaining-*` headers.
    pub remaining: [Option<u64>; 3],
    cluster: Arc<Cluster>,
    key: String,
    limits: TenantLimits,
    lease: Option<Lease>,
}

impl std::fmt::Debug for TenantHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TenantHold({})", self.key)
    }
}

impl TenantHold {
    /// Gives the concurrency lease back (the answer ended).
    pub fn release(&mut self) {
        self.lease = None;
    }

    /// Corrects the fleet's buckets by `give_back` (requests, input, output; reserved minus
    /// used), off the request's path, and gives the lease back.
    pub fn settle(mut self, give_back: [i64; 3]) {
        self.lease = None;
        let l = self.limits.per_minute;
        if give_back
            .iter()
            .zip(l)
            .all(|(d, limit)| *d == 0 || limit == 0)
        {
            return;
        }
        let key = std::mem::take(&mut self.key);
        self.cluster.send(Op::Settle {
            key,
            limits: l,
            give_back,
        });
    }
}

/// A write for the writer task.
enum Op {
    Publish(Vec<u8>),
    SetSession {
        key: String,
        value: String,
        ttl_ms: u64,
    },
    Release {
        key: String,
        member: String,
        /// The event that wakes the other replicas' queues (none for a tenant's lease).
        event: Option<Vec<u8>>,
    },
    Settle {
        key: String,
        limits: [u64; 3],
        give_back: [i64; 3],
    },
}

/// The cluster's metric families, registered with or without `cluster:` (zero without it, so
/// dashboards and the status page show them either way).
#[derive(Clone)]
pub struct ClusterMetrics {
    /// Redis calls by operation and result.
    calls: IntCounterVec,
    /// Routing decisions made on local state because Redis was not there (by what was
    /// skipped).
    fallbacks: IntCounterVec,
    degraded: IntGauge,
    /// Events received from other replicas and applied, by kind.
    applied: IntCounterVec,
    /// Writes dropped (degraded, or the writer behind).
    dropped: prometheus::IntCounter,
    /// Round trips on the routing path (session read, lease script).
    rtt: Histogram,
}

impl ClusterMetrics {
    pub fn new(r: &Registry) -> ClusterMetrics {
        let calls = IntCounterVec::new(
            Opts::new(
                "tokengate_cluster_redis_calls_total",
                "Redis calls of the cluster state, by operation and result (ok, error, timeout)",
            ),
            &["op", "result"],
        )
        .expect("metric");
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "tokengate_cluster_local_fallbacks_total",
                "Requests routed on local state only because Redis was unreachable or slow, by what was skipped",
            ),
            &["what"],
        )
        .expect("metric");
        let degraded = IntGauge::new(
            "tokengate_cluster_degraded",
            "1 while this replica cannot reach Redis and routes on local state",
        )
        .expect("metric");
        let applied = IntCounterVec::new(
            Opts::new(
                "tokengate_cluster_events_applied_total",
                "Events of other replicas applied to this one's state, by kind",
            ),
            &["kind"],
        )
        .expect("metric");
        let dropped = prometheus::IntCounter::new(
            "tokengate_cluster_writes_dropped_total",
            "Shared-state writes not sent (Redis unreachable, or the writer behind)",
        )
        .expect("metric");
        let rtt = Histogram::with_opts(
            HistogramOpts::new(
                "tokengate_cluster_redis_rtt_seconds",
                "Redis round trips on the routing path (session read, slot lease)",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
            ]),
        )
        .expect("metric");
        for c in [
            Box::new(calls.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(fallbacks.clone()),
            Box::new(degraded.clone()),
            Box::new(applied.clone()),
            Box::new(dropped.clone()),
            Box::new(rtt.clone()),
        ] {
            let _ = r.register(c);
        }
        for op in OPS {
            for result in ["ok", "error", "timeout"] {
                calls.with_label_values(&[op, result]);
            }
        }
        for what in ["session", "lease", "tenant"] {
            fallbacks.with_label_values(&[what]);
        }
        for kind in ["placed", "trimmed", "released"] {
            applied.with_label_values(&[kind]);
        }
        ClusterMetrics {
            calls,
            fallbacks,
            degraded,
            applied,
            dropped,
            rtt,
        }
    }
}

/// The Redis operations counted in `tokengate_cluster_redis_calls_total{op}`.
const OPS: [&str; 7] = [
    "session_get",
    "lease",
    "tenant",
    "write",
    "heartbeat",
    "members",
    "load",
];

impl ClusterMetrics {
    /// The counters for `/admin/status`.
    pub fn view(&self) -> serde_json::Value {
        let calls = |result: &str| -> u64 {
            OPS.iter()
                .map(|op| self.calls.with_label_values(&[op, result]).get())
                .sum()
        };
        let applied = |k: &str| self.applied.with_label_values(&[k]).get();
        let fallback = |w: &str| self.fallbacks.with_label_values(&[w]).get();
        serde_json::json!({
            "degraded": self.degraded.get(),
            "redis_calls": {"ok": calls("ok"), "error": calls("error"), "timeout": calls("timeout")},
            "rtt": {
                "count": self.rtt.get_sample_count(),
                "mean_ms": if self.rtt.get_sample_count() > 0 {
                    self.rtt.get_sample_sum() * 1000.0 / self.rtt.get_sample_count() as f64
                } else {
                    0.0
                },
            },
            "events_applied": {"placed": applied("placed"), "trimmed": applied("trimmed"), "released": applied("released")},
            "local_fallbacks": {"session": fallback("session"), "lease": fallback("lease"), "tenant": fallback("tenant")},
            "writes_dropped": self.dropped.get(),
        })
    }
}

/// This replica's membership of the cluster and its client of the shared state.
pub struct Cluster {
    pub replica: String,
    /// The settings as started (a reload that changes them is told they need a restart;
    /// compared only, never shown: it holds the URL's password).
    pub settings_key: String,
    url: String,
    client: redis::Client,
    prefix: String,
    timeout: Duration,
    heartbeat: Duration,
    lease_ms: u64,
    conn: OnceLock<ConnectionManager>,
    state: AtomicU8,
    outbox: mpsc::Sender<Op>,
    inbox: Mutex<Option<mpsc::Receiver<Op>>>,
    /// Live leases: id → (lease set, member).
    leases: Mutex<HashMap<u64, (String, String)>>,
    next_lease: AtomicU64,
    acquire: redis::Script,
    tenant_script: redis::Script,
    heartbeat_script: redis::Script,
    members_script: redis::Script,
    load_script: redis::Script,
    m: ClusterMetrics,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("replica", &self.replica)
            .field("redis", &self.url)
            .finish()
    }
}

/// The answer of [`Cluster::acquire`].
pub enum Acquired {
    /// The fleet-wide slot, held until dropped.
    Slot(Lease),
    /// The fleet already uses every slot of the instance.
    Full,
    /// Redis did not answer: the local limits alone decide.
    Unknown,
}

/// A fleet-wide throttling slot; dropping it gives it back.
pub struct Lease {
    cluster: Arc<Cluster>,
    id: u64,
    service: String,
    /// A `prefill` slot, given back at the first token.
    pub prefill: bool,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.id)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some((key, member)) = self.cluster.leases.lock().remove(&self.id) else {
            return;
        };
        let event = (!self.service.is_empty()).then(|| {
            Event {
                kind: Kind::Released,
                origin: self.cluster.replica.clone(),
                service: std::mem::take(&mut self.service),
                instance: String::new(),
                blocks: Vec::new(),
            }
            .encode()
        });
        self.cluster.send(Op::Release { key, member, event });
    }
}

/// What identifies `cluster:` settings (see [`Cluster::settings_key`]).
pub fn settings_key(cfg: &ClusterSettings) -> String {
    // `placement` is the schedulers', rebuilt on every reload.
    format!("{:?}", (&cfg.redis, &cfg.replica, cfg.heartbeat, cfg.lease))
}

fn default_replica() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "replica".into());
    let rnd = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &rnd[..6])
}

impl Cluster {
    /// The cluster client of validated settings (no connection yet: [`run`] connects).
    pub fn new(cfg: &ClusterSettings, m: ClusterMetrics) -> Result<Arc<Cluster>, String> {
        let r = cfg
            .redis
            .as_ref()
            .ok_or("cluster.redis: required for shared state")?;
        let client = redis::Client::open(r.url.as_str()).map_err(|e| {
            format!(
                "cluster.redis.url: {:?} is not a valid Redis URL: {e}",
                masked_url(&r.url)
            )
        })?;
        let (tx, rx) = mpsc::channel(OUTBOX);
        Ok(Arc::new(Cluster {
            replica: cfg.replica.clone().unwrap_or_else(default_replica),
            settings_key: settings_key(cfg),
            url: masked_url(&r.url),
            client,
            prefix: r.key_prefix.clone(),
            timeout: r.timeout,
            heartbeat: cfg.heartbeat,
            lease_ms: cfg.lease.as_millis() as u64,
            conn: OnceLock::new(),
            state: AtomicU8::new(CONNECTING),
            outbox: tx,
            inbox: Mutex::new(Some(rx)),
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(0),
            acquire: redis::Script::new(ACQUIRE),
            tenant_script: redis::Script::new(TENANT_ADMIT),
            heartbeat_script: redis::Script::new(HEARTBEAT),
            members_script: redis::Script::new(MEMBERS),
            load_script: redis::Script::new(LOAD_SYNC),
            m,
        }))
    }

    fn key(&self, rest: &str) -> String {
        format!("{}:{rest}", self.prefix)
    }

    /// Whether requests use Redis now (connected, not degraded).
    pub fn usable(&self) -> bool {
        self.state.load(Relaxed) == OK && self.conn.get().is_some()
    }

    /// `ok`, `connecting` or `degraded`.
    pub fn state_name(&self) -> &'static str {
        match self.state.load(Relaxed) {
            OK => "ok",
            CONNECTING => "connecting",
            _ => "degraded",
        }
    }

    /// A call failed or timed out: degraded (warned once per outage).
    fn failed(&self, op: &str, why: &str) {
        self.m.calls.with_label_values(&[op, why]).inc();
        if self.state.swap(DEGRADED, Relaxed) != DEGRADED {
            self.m.degraded.set(1);
            warn!(
                "cluster: Redis at {} did not answer ({op}: {why}); routing on this replica's local state until it is back (cluster: degraded)",
                self.url
            );
        }
    }

    fn answered(&self, op: &str) {
        self.m.calls.with_label_values(&[op, "ok"]).inc();
    }

    /// A heartbeat went through: connected again.
    fn recovered(&self) {
        let was = self.state.swap(OK, Relaxed);
        self.m.degraded.set(0);
        match was {
            DEGRADED => info!(
                "cluster: Redis at {} answers again; sharing state with the other replicas",
                self.url
            ),
            CONNECTING => info!(
                "cluster: replica {} joined through Redis at {}",
                self.replica, self.url
            ),
            _ => {}
        }
    }

    /// Runs `f` on the connection within the timeout; `None` (and degraded) on failure.
    async fn call<T, F, Fut>(&self, op: &str, f: F) -> Option<T>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let conn = self.conn.get()?.clone();
        match tokio::time::timeout(self.timeout, f(conn)).await {
            Ok(Ok(v)) => {
                self.answered(op);
                Some(v)
            }
            Ok(Err(e)) => {
                self.failed(op, "error");
                log::debug!("cluster: {op}: {e}");
                None
            }
            Err(_) => {
                self.failed(op, "timeout");
                None
            }
        }
    }

    fn send(&self, op: Op) {
        if !self.usable() || self.outbox.try_send(op).is_err() {
            self.m.dropped.inc();
        }
    }

    fn session_key(&self, scope: &str, s: SessionKey) -> String {
        self.key(&format!("s:{scope}:{:016x}", s.0))
    }

    /// The instance id a session is bound to in the fleet (the routing path's one read).
    pub async fn session(&self, scope: &str, s: SessionKey) -> Option<String> {
        if !self.usable() {
            self.m.fallbacks.with_label_values(&["session"]).inc();
            return None;
        }
        let key = self.session_key(scope, s);
        let t = std::time::Instant::now();
        let r = self
            .call("session_get", |mut c| async move {
                redis::cmd("GET")
                    .arg(&key)
                    .query_async::<Option<String>>(&mut c)
                    .await
            })
            .await;
        self.m.rtt.observe(t.elapsed().as_secs_f64());
        if r.is_none() {
            self.m.fallbacks.with_label_values(&["session"]).inc();
        }
        r.flatten()
    }

    /// Writes a session's binding for the other replicas (off the request's path).
    pub fn bind(&self, scope: &str, s: SessionKey, instance: &str, ttl_ms: u64) {
        self.send(Op::SetSession {
            key: self.session_key(scope, s),
            value: instance.to_string(),
            ttl_ms: ttl_ms.max(1),
        });
    }

    /// Publishes a dispatch's placement (the prompt's blocks now on `instance`).
    pub fn placed(&self, service: &str, instance: &str, blocks: &[u64]) {
        if blocks.is_empty() {
            return;
        }
        self.publish(Kind::Placed, service, instance, blocks);
    }

    /// Publishes a self-correcting trim.
    pub fn trimmed(&self, service: &str, instance: &str, blocks: &[u64], keep: usize) {
        let keep = keep.min(u32::MAX as usize) as u32;
        self.publish(Kind::Trimmed { keep }, service, instance, blocks);
    }

    fn publish(&self, kind: Kind, service: &str, instance: &str, blocks: &[u64]) {
        if !self.usable() {
            self.m.dropped.inc();
            return;
        }
        let e = Event {
            kind,
            origin: self.replica.clone(),
            service: service.to_string(),
            instance: instance.to_string(),
            blocks: blocks.to_vec(),
        };
        self.send(Op::Publish(e.encode()));
    }

    /// Takes a fleet-wide slot of `phase` (`total`, `prefill`, `decode`) on an instance
    /// whose limit is `limit`.
    pub async fn acquire(
        self: &Arc<Self>,
        service: &str,
        instance: &str,
        phase: &'static str,
        limit: u64,
    ) -> Acquired {
        if !self.usable() {
            self.m.fallbacks.with_label_values(&["lease"]).inc();
            return Acquired::Unknown;
        }
        let key = self.key(&format!("lease:{service}:{instance}:{phase}"));
        let id = self.next_lease.fetch_add(1, Relaxed);
        let member = format!("{}#{id}", self.replica);
        let t = std::time::Instant::now();
        let (k, mb, ms) = (key.clone(), member.clone(), self.lease_ms);
        let script = self.acquire.clone();
        let r = self
            .call("lease", |mut c| async move {
                script
                    .key(&k)
                    .arg(limit)
                    .arg(&mb)
                    .arg(ms)
                    .invoke_async::<i64>(&mut c)
                    .await
            })
            .await;
        self.m.rtt.observe(t.elapsed().as_secs_f64());
        match r {
            Some(1) => {
                self.leases.lock().insert(id, (key, member));
                Acquired::Slot(Lease {
                    cluster: self.clone(),
                    id,
                    service: service.to_string(),
                    prefill: phase == "prefill",
                })
            }
            Some(_) => Acquired::Full,
            None => {
                // It may have been taken without the answer arriving: it expires unrenewed.
                self.m.fallbacks.with_label_values(&["lease"]).inc();
                Acquired::Unknown
            }
        }
    }

    /// The key of a session's binding (for [`Cluster::admit_tenant`]'s read along).
    pub fn session_ref(&self, scope: &str, s: SessionKey) -> String {
        self.session_key(scope, s)
    }

    /// Takes a request of tenant `name` off its fleet-wide limits (`input`, `output` tokens
    /// reserved), reading `session` (a [`Cluster::session_ref`]) in the same round trip.
    pub async fn admit_tenant(
        self: &Arc<Self>,
        name: &str,
        limits: TenantLimits,
        input: u64,
        output: u64,
        session: Option<&str>,
    ) -> TenantAdmission {
        if !self.usable() {
            self.m.fallbacks.with_label_values(&["tenant"]).inc();
            return TenantAdmission::Unknown;
        }
        let key = self.key(&format!("tenant:{name}"));
        let lease_key = format!("{key}:inflight");
        let id = self.next_lease.fetch_add(1, Relaxed);
        let member = format!("{}#{id}", self.replica);
        let script = self.tenant_script.clone();
        let (k, lk, mb, ms) = (
            key.clone(),
            lease_key.clone(),
            member.clone(),
            self.lease_ms,
        );
        let sk = session.map(str::to_string);
        let t = std::time::Instant::now();
        let r = self
            .call("tenant", |mut c| async move {
                let mut inv = script.key(&k);
                inv.key(&lk);
                if let Some(sk) = &sk {
                    inv.key(sk);
                }
                inv.arg(&limits.per_minute[..])
                    .arg(limits.concurrency)
                    .arg(input)
                    .arg(output)
                    .arg(&mb)
                    .arg(ms);
                inv.invoke_async::<(i64, i64, i64, Option<String>, i64, i64, i64)>(&mut c)
                    .await
            })
            .await;
        self.m.rtt.observe(t.elapsed().as_secs_f64());
        match r {
            Some((1, _, _, session, r, i, o)) => {
                let lease = (limits.concurrency > 0).then(|| {
                    self.leases.lock().insert(id, (lease_key, member));
                    Lease {
                        cluster: self.clone(),
                        id,
                        service: String::new(),
                        prefill: false,
                    }
                });
                let left = |v: i64| u64::try_from(v).ok();
                TenantAdmission::Admitted {
                    hold: TenantHold {
                        remaining: [left(r), left(i), left(o)],
                        cluster: self.clone(),
                        key,
                        limits,
                        lease,
                    },
                    session,
                }
            }
            Some((_, limit, ms, ..)) => TenantAdmission::Refused {
                limit: limit.clamp(1, 4) as u8,
                retry_after: Duration::from_millis(ms.max(1) as u64),
            },
            None => {
                // A lease may have been taken without the answer arriving: it expires
                // unrenewed.
                self.m.fallbacks.with_label_values(&["tenant"]).inc();
                TenantAdmission::Unknown
            }
        }
    }

    /// How often the replicas exchange their in-flight figures: a tenth of the heartbeat,
    /// 50 ms to 1 s.
    pub fn load_every(&self) -> Duration {
        (self.heartbeat / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
    }

    /// Publishes this replica's in-flight figures (`[requests, tokens, waiting, prefill
    /// tokens]` by instance id, the non-zero ones) and returns the sum of the other
    /// replicas' by instance id; `None` when Redis is not usable (nothing is known then).
    pub async fn sync_load(&self, own: &[(String, [u64; 4])]) -> Option<HashMap<String, [u64; 4]>> {
        if !self.usable() {
            return None;
        }
        let script = self.load_script.clone();
        let replicas = self.key("replicas");
        let keep = (self.load_every() * 5).as_millis() as u64;
        let (prefix, id) = (self.prefix.clone(), self.replica.clone());
        let args: Vec<String> = own
            .iter()
            .flat_map(|(i, v)| [i.clone(), format!("{},{},{},{}", v[0], v[1], v[2], v[3])])
            .collect();
        let flat = self
            .call("load", |mut c| async move {
                let mut inv = script.key(&replicas);
                inv.arg(&prefix).arg(&id).arg(keep);
                for a in &args {
                    inv.arg(a);
                }
                inv.invoke_async::<Vec<String>>(&mut c).await
            })
            .await?;
        let mut sum: HashMap<String, [u64; 4]> = HashMap::new();
        for p in flat.chunks_exact(2) {
            let mut v = [0u64; 4];
            for (slot, x) in v.iter_mut().zip(p[1].split(',')) {
                *slot = x.parse().unwrap_or(0);
            }
            let e = sum.entry(p[0].clone()).or_default();
            for (a, b) in e.iter_mut().zip(v) {
                *a += b;
            }
        }
        Some(sum)
    }

    /// Leases this replica holds now.
    pub fn leases_held(&self) -> usize {
        self.leases.lock().len()
    }

    /// `/admin/cluster`: this replica, Redis's state and the replicas registered.
    pub async fn view(&self) -> serde_json::Value {
        let hb = self.heartbeat.as_millis() as u64;
        let members = if self.usable() {
            let key = self.key("replicas");
            let script = self.members_script.clone();
            self.call("members", |mut c| async move {
                script.key(&key).invoke_async::<Vec<String>>(&mut c).await
            })
            .await
        } else {
            None
        };
        let replicas: Vec<serde_json::Value> = match &members {
            Some(v) if !v.is_empty() => {
                let now: u64 = v[0].parse().unwrap_or(0);
                v[1..]
                    .chunks_exact(2)
                    .map(|p| {
                        let seen: u64 = p[1].parse::<f64>().unwrap_or(0.0) as u64;
                        let age = now.saturating_sub(seen);
                        serde_json::json!({
                            "replica": p[0],
                            "self": p[0] == self.replica,
                            "last_seen_ms_ago": age,
                            "health": if age <= 3 * hb { "healthy" } else { "missing" },
                        })
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        serde_json::json!({
            "enabled": true,
            "replica": self.replica,
            "redis": self.url,
            "state": self.state_name(),
            "heartbeat_ms": hb,
            "lease_ms": self.lease_ms,
            "leases_held": self.leases_held(),
            "replicas": replicas,
            "replicas_known": members.is_some(),
        })
    }

    /// The short summary in `/admin/instances` and the status page.
    pub fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "replica": self.replica,
            "state": self.state_name(),
            "summary": format!("cluster: {}", self.state_name()),
        })
    }
}

/// The cluster's background work: connection, heartbeat (membership, lease renewal, the
/// probe of a degraded replica), the writer of shared state and the subscriber to the
/// other replicas' events.
/// `apply` gets the events of the other replicas (see `crate::background::cluster`).
pub async fn run(
    c: Arc<Cluster>,
    apply: impl Fn(Event) + Send + Sync + 'static,
    stop: pingora::server::ShutdownWatch,
) {
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(c.timeout.max(Duration::from_millis(200))))
        .set_response_timeout(Some(c.timeout.max(Duration::from_millis(200))))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1));
    match ConnectionManager::new_lazy_with_config(c.client.clone(), cfg) {
        Ok(m) => {
            let _ = c.conn.set(m);
        }
        Err(e) => {
            warn!(
                "cluster: cannot set up the Redis client of {}: {e}; this replica runs on its own",
                c.url
            );
            return;
        }
    }
    let rx = c.inbox.lock().take();
    let writer = rx.map(|rx| tokio::spawn(write_loop(c.clone(), rx)));
    let sub = tokio::spawn(subscribe_loop(apply, c.clone(), stop.clone()));
    heartbeat_loop(&c, stop).await;
    sub.abort();
    if let Some(w) = writer {
        w.abort();
    }
}

async fn heartbeat_loop(c: &Arc<Cluster>, mut stop: pingora::server::ShutdownWatch) {
    let hb = c.heartbeat;
    let forget = hb.as_millis() as u64 * 10;
    let mut backoff = Duration::from_millis(100);
    loop {
        let snapshot: Vec<(u64, String, String)> = c
            .leases
            .lock()
            .iter()
            .map(|(id, (k, m))| (*id, k.clone(), m.clone()))
            .collect();
        let leases: Vec<(String, String)> = snapshot
            .iter()
            .map(|(_, k, m)| (k.clone(), m.clone()))
            .collect();
        let script = c.heartbeat_script.clone();
        let (replicas, id, lease_ms) = (c.key("replicas"), c.replica.clone(), c.lease_ms);
        let conn = c.conn.get().cloned();
        let r = match conn {
            Some(mut conn) => {
                let call = async move {
                    let mut inv = script.key(&replicas);
                    inv.arg(&id).arg(lease_ms).arg(forget);
                    for (k, m) in &leases {
                        inv.key(k).arg(m);
                    }
                    inv.invoke_async::<i64>(&mut conn).await
                };
                // The heartbeat may wait longer than a request would (a busy Redis).
                tokio::time::timeout(c.timeout.max(Duration::from_millis(250)) * 2, call).await
            }
            None => return,
        };
        let next = match r {
            Ok(Ok(fresh)) => {
                c.answered("heartbeat");
                c.recovered();
                if fresh == 1 {
                    // Re-registered: the script added back every lease of the snapshot; one
                    // given back since (its removal may have reached Redis first) goes again.
                    let held = c.leases.lock();
                    let gone: Vec<_> = snapshot
                        .into_iter()
                        .filter(|(id, _, _)| !held.contains_key(id))
                        .collect();
                    drop(held);
                    for (_, key, member) in gone {
                        c.send(Op::Release {
                            key,
                            member,
                            event: None,
                        });
                    }
                }
                backoff = Duration::from_millis(100);
                hb
            }
            Ok(Err(e)) => {
                log::debug!("cluster: heartbeat: {e}");
                c.failed("heartbeat", "error");
                backoff = (backoff * 2).min(hb.max(Duration::from_millis(100)));
                backoff
            }
            Err(_) => {
                c.failed("heartbeat", "timeout");
                backoff = (backoff * 2).min(hb.max(Duration::from_millis(100)));
                backoff
            }
        };
        if !crate::clock::sleep_or_stop(next, &mut stop).await {
            return;
        }
    }
}

async fn write_loop(c: Arc<Cluster>, mut rx: mpsc::Receiver<Op>) {
    let events = c.key("events");
    let mut batch = Vec::with_capacity(256);
    while let Some(op) = rx.recv().await {
        batch.push(op);
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        if !c.usable() {
            c.m.dropped.inc_by(batch.len() as u64);
            batch.clear();
            continue;
        }
        let mut p = redis::pipe();
        for op in batch.drain(..) {
            match op {
                Op::Publish(b) => {
                    p.cmd("PUBLISH").arg(&events).arg(b).ignore();
                }
                Op::SetSession { key, value, ttl_ms } => {
                    p.cmd("SET")
                        .arg(key)
                        .arg(value)
                        .arg("PX")
                        .arg(ttl_ms)
                        .ignore();
                }
                Op::Release { key, member, event } => {
                    p.cmd("ZREM").arg(key).arg(member).ignore();
                    if let Some(event) = event {
                        p.cmd("PUBLISH").arg(&events).arg(event).ignore();
                    }
                }
                Op::Settle {
                    key,
                    limits,
                    give_back,
                } => {
                    p.cmd("EVAL")
                        .arg(TENANT_SETTLE)
                        .arg(1)
                        .arg(key)
                        .arg(&limits[..])
                        .arg(&give_back[..])
                        .ignore();
                }
            }
        }
        c.call("write", |mut conn| async move {
            p.query_async::<()>(&mut conn).await
        })
        .await;
    }
}

async fn subscribe_loop(
    apply: impl Fn(Event) + Send + Sync + 'static,
    c: Arc<Cluster>,
    mut stop: pingora::server::ShutdownWatch,
) {
    use futures_util::StreamExt;
    let channel = c.key("events");
    let mut backoff = Duration::from_millis(100);
    loop {
        let connect = async {
            let mut ps = c.client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        match tokio::time::timeout(Duration::from_secs(2), connect).await {
            Ok(Ok(ps)) => {
                backoff = Duration::from_millis(100);
                let mut msgs = ps.into_on_message();
                loop {
                    tokio::select! {
                        m = msgs.next() => match m {
                            Some(m) => {
                                if let Some(e) = Event::decode(m.get_payload_bytes()) {
                                    if e.origin != c.replica {
                                        apply(e);
                                    }
                                }
                            }
                            None => break,
                        },
                        r = stop.changed() => if r.is_err() || *stop.borrow() { return },
                    }
                }
                log::debug!("cluster: the event subscription closed; reconnecting");
            }
            Ok(Err(e)) => log::debug!("cluster: subscribe: {e}"),
            Err(_) => log::debug!("cluster: subscribe: timed out"),
        }
        if !crate::clock::sleep_or_stop(backoff, &mut stop).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

impl Cluster {
    /// Counts an applied event of another replica (`placed`, `trimmed`, `released`).
    pub fn count_applied(&self, kind: &str) {
        self.m.applied.with_label_values(&[kind]).inc();
    }
}
