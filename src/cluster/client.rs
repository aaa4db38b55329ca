//! This replica's client of the shared state: its connection and state (ok, connecting,
//! degraded), the calls within the timeout, the writer's outbox, session bindings and
//! placement events, and the `/admin/cluster` view.

use super::metrics::ClusterMetrics;
use super::minute::Usage;
use super::scripts::{ACQUIRE, HEARTBEAT, MEMBERS, SYNC, TENANT_ADMIT};
use super::wire::{Event, Kind};
use crate::config::{masked_url, ClusterSettings};
use log::{info, warn};
use parking_lot::Mutex;
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokengate_plugins::SessionKey;
use tokio::sync::mpsc;

/// Not connected yet (the first heartbeat has not answered).
const CONNECTING: u8 = 0;
const OK: u8 = 1;
const DEGRADED: u8 = 2;

/// Most writes waiting for the writer; beyond it a write is dropped and counted (Redis is
/// slower than the traffic: the replica routes on local state for those).
const OUTBOX: usize = 16_384;

/// A write for the writer task.
pub(super) enum Op {
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

/// This replica's membership of the cluster and its client of the shared state.
pub struct Cluster {
    pub replica: String,
    /// The settings as started (a reload that changes them is told they need a restart;
    /// compared only, never shown: it holds the URL's password).
    pub settings_key: String,
    pub(super) url: String,
    pub(super) client: redis::Client,
    pub(super) prefix: String,
    pub(super) timeout: Duration,
    pub(super) heartbeat: Duration,
    pub(super) lease_ms: u64,
    pub(super) conn: OnceLock<ConnectionManager>,
    pub(super) state: AtomicU8,
    pub(super) outbox: mpsc::Sender<Op>,
    pub(super) inbox: Mutex<Option<mpsc::Receiver<Op>>>,
    /// Live leases: id → (lease set, member).
    pub(super) leases: Mutex<HashMap<u64, (String, String)>>,
    pub(super) next_lease: AtomicU64,
    pub(super) acquire: redis::Script,
    pub(super) tenant_script: redis::Script,
    pub(super) heartbeat_script: redis::Script,
    pub(super) members_script: redis::Script,
    pub(super) sync_script: redis::Script,
    /// The store's epoch as last seen (see [`HEARTBEAT`]).
    pub(super) epoch: Mutex<Option<String>>,
    /// What this replica charged to each tenant's fleet-wide buckets lately, by bucket key.
    pub(super) usage: Mutex<HashMap<String, Usage>>,
    pub(super) m: ClusterMetrics,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("replica", &self.replica)
            .field("redis", &self.url)
            .finish()
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
    /// The cluster client of validated settings (no connection yet: [`super::run`] connects).
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
            sync_script: redis::Script::new(SYNC),
            epoch: Mutex::new(None),
            usage: Mutex::new(HashMap::new()),
            m,
        }))
    }

    pub(super) fn key(&self, rest: &str) -> String {
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
    pub(super) fn failed(&self, op: &str, why: &str) {
        self.m.calls.with_label_values(&[op, why]).inc();
        if self.state.swap(DEGRADED, Relaxed) != DEGRADED {
            self.m.degraded.set(1);
            warn!(
                "cluster: Redis at {} did not answer ({op}: {why}); routing on this replica's local state until it is back (cluster: degraded)",
                self.url
            );
        }
    }

    pub(super) fn answered(&self, op: &str) {
        self.m.calls.with_label_values(&[op, "ok"]).inc();
    }

    /// A heartbeat went through: connected again.
    pub(super) fn recovered(&self) {
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
    pub(super) async fn call<T, F, Fut>(&self, op: &str, f: F) -> Option<T>
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

    pub(super) fn send(&self, op: Op) {
        if !self.usable() || self.outbox.try_send(op).is_err() {
            self.m.dropped.inc();
        }
    }

    pub(super) fn session_key(&self, scope: &str, s: SessionKey) -> String {
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

    pub(super) fn publish(&self, kind: Kind, service: &str, instance: &str, blocks: &[u64]) {
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

    /// The key of a session's binding (for [`Cluster::admit_tenant`]'s read along).
    pub fn session_ref(&self, scope: &str, s: SessionKey) -> String {
        self.session_key(scope, s)
    }

    /// How often the replicas exchange their in-flight figures: a tenth of the heartbeat,
    /// 50 ms to 1 s.
    pub fn load_every(&self) -> Duration {
        (self.heartbeat / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
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

    /// Counts an applied event of another replica (`placed`, `trimmed`, `released`).
    pub fn count_applied(&self, kind: &str) {
        self.m.applied.with_label_values(&[kind]).inc();
    }
}
