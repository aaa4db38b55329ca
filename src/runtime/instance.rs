//! One engine instance: its address, live load, health and engine signals, and how it is
//! built from `services[].instances[]` (names resolved, the previous runtime's state of the
//! same instance carried over).

use crate::config::{InstanceConfig, ServiceConfig};
use crate::engine_metrics::EngineSignals;
use crate::health::Health;
use crate::load::{HasLoad, InstanceLoad, Limits};
use crate::resolve::Target;
use crate::throttle::Throttle;
use crate::tls::TlsPeer;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokengate_plugins::{Candidate, InstanceKey, PrefixIndex, Role};

/// One engine instance.
#[derive(Debug)]
pub struct Instance {
    pub id: String,
    /// `id` as the `x-tokengate-instance` response header, built once.
    pub id_header: http::HeaderValue,
    pub addr: SocketAddr,
    pub service: String,
    pub labels: BTreeMap<String, String>,
    /// Position of the instance in its service.
    pub idx: usize,
    /// Stable key of the id for the routing plugins (session table, prefix index).
    pub key: InstanceKey,
    /// Shared with the same instance in the next config after a reload.
    pub load: Arc<InstanceLoad>,
    /// Its requests held at the gateway while it is saturated (kept across reloads).
    pub queue: Arc<crate::engine_queue::EngineQueue>,
    /// The other replicas' in-flight figures here (`cluster:`; kept across reloads).
    pub remote: Arc<crate::load::RemoteLoad>,
    pub health: Arc<Health>,
    /// The engine's own load figures, when the service scrapes them (kept across reloads).
    pub engine: Arc<EngineSignals>,
    /// How old a scrape may be and still count (3 intervals); `None` when not scraped.
    pub engine_max_age_ms: Option<u64>,
    /// The service's throttle (a released slot wakes its queue).
    pub throttle: Option<Arc<Throttle>>,
    /// Instance-scope slot limits (zero: none). A decode node's `decode` limit is its
    /// `total` here (it counts requests from dispatch, waiting for their KV, to completion).
    pub limits: Limits,
    /// Integrated, or prefill / decode in a disaggregated service.
    pub role: Role,
    /// A prefill node's bootstrap port (SGLang).
    pub bootstrap_port: Option<u16>,
    /// An `https://` instance: SNI, verification, the CA.
    pub tls: Option<Arc<crate::tls::TlsPeer>>,
    /// `cache_tokens` as configured.
    pub config_cache_tokens: Option<u64>,
    /// `engine_metrics.cache_size`: without `cache_tokens`, the engine's reported size counts.
    pub engine_cache_size: bool,
    /// `cache_block_tokens` as configured.
    pub config_block_tokens: Option<u64>,
    /// `http[s]://host:port` as configured (side requests, health checks, metric scrapes).
    pub origin: String,
    /// `host:port` as configured: the `Host` header sent to the engine.
    pub host_header: http::HeaderValue,
    /// `Bearer <api_key>` for the engine (sensitive: never logged or shown).
    pub auth: Option<http::HeaderValue>,
}

impl HasLoad for Instance {
    fn load(&self) -> &InstanceLoad {
        &self.load
    }
    fn released(&self) {
        if let Some(t) = &self.throttle {
            t.kick();
        }
    }
}

impl Instance {
    /// The most blocks the prefix index lets this instance hold: [`Self::cache_tokens`] in
    /// blocks of `block_tokens`. `None`: unbounded (also for a size under one block).
    pub fn cache_blocks(&self, block_tokens: usize) -> Option<u64> {
        self.cache_tokens()
            .map(|t| t / block_tokens.max(1) as u64)
            .filter(|b| *b > 0)
    }

    /// The engine's KV cache in tokens as the engine counts them, when known: `cache_tokens`,
    /// else (with `engine_metrics.cache_size`) what its engine reports.
    pub fn engine_cache_tokens(&self) -> Option<u64> {
        self.config_cache_tokens
            .or_else(|| {
                self.engine_cache_size
                    .then(|| self.engine.cache_tokens())
                    .flatten()
            })
            .filter(|t| *t > 0)
    }

    /// [`Self::engine_cache_tokens`] in the gateway's estimated tokens (the unit of the
    /// prefix index and of the in-flight figures): divided by the engine's tokens per
    /// estimated token, as learned from its reports (an engine whose tokenizer counts twice
    /// the estimate holds half as many estimated tokens).
    pub fn cache_tokens(&self) -> Option<u64> {
        let ratio = self.engine.tokens_per_estimate().unwrap_or(1.0);
        self.engine_cache_tokens()
            .map(|t| (t as f64 / ratio) as u64)
            .filter(|t| *t > 0)
    }

    /// The tokens per block the engine caches in: `cache_block_tokens`, else what its metrics
    /// or its cached-token counts said ([`EngineSignals::block_tokens`]), else 1.
    pub fn engine_block_tokens(&self) -> u64 {
        self.config_block_tokens
            .or_else(|| self.engine.block_tokens())
            .unwrap_or(1)
            .max(1)
    }

    /// The URL of `path` on the instance: its configured origin when it is `https://` (TLS
    /// needs the name), else the address it resolved to.
    pub fn url(&self, path: &str) -> String {
        match &self.tls {
            Some(_) => format!("{}{path}", self.origin),
            None => format!("http://{}{path}", self.addr),
        }
    }

    /// A request to `path` on the instance with its API key.
    pub fn request(
        &self,
        client: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let r = client.request(method, self.url(path));
        match &self.auth {
            Some(a) => r.header(reqwest::header::AUTHORIZATION, a.clone()),
            None => r,
        }
    }

    /// An instance with a known cache size (`cache_tokens`, or its engine's metrics) that the
    /// prefix index believes holds more loses its least recently used entries down to 95 %
    /// of it (the margin: the tree walk runs once per 5 % of the cache that turns over, not
    /// on every request).
    pub fn bound_index(&self, index: &PrefixIndex, block_tokens: usize) {
        if let Some(cap) = self.cache_blocks(block_tokens) {
            if index.held_blocks(self.key) > cap {
                let removed = index.evict_instance_to(self.key, cap - cap / 20);
                log::debug!(
                    "prefix index: {} held more than its cache ({cap} blocks): {removed} least recently used blocks forgotten",
                    self.id
                );
            }
        }
    }

    /// Feeds a request's outcome to the instance's passive health (`passive_health`).
    pub fn passive(&self, failed: bool, p: &crate::config::PassiveHealthSettings, now: u64) {
        let eject_ms = p.eject_for.as_millis() as u64;
        if self
            .health
            .on_request(failed, p.max_failures, eject_ms, now)
        {
            log::warn!(
                "instance {} ejected for {:?} after {} consecutive failed requests",
                self.id,
                p.eject_for,
                p.max_failures
            );
        }
    }

    /// The instance as a scheduling candidate; `idx` and `target` are the caller's numbering,
    /// `index` its service's prefix index (what it is believed to hold).
    pub fn candidate(
        &self,
        idx: usize,
        target: u32,
        now_ms: u64,
        index: &PrefixIndex,
    ) -> Candidate {
        let s = self.load.snapshot();
        // The fleet's load: the other replicas' bookings here (zero without a cluster).
        let [rr, rt, rw, rp] = self.remote.get();
        Candidate {
            idx,
            key: self.key,
            target,
            role: self.role,
            available: self.health.available(now_ms),
            inflight_requests: s.inflight_requests + rr,
            inflight_tokens: s.inflight_tokens + rt,
            waiting: s.waiting + rw,
            prefill_tokens: s.prefill_tokens + rp,
            engine: self
                .engine_max_age_ms
                .and_then(|age| self.engine.fresh(now_ms, age)),
            full: (self.limits.prefill > 0 && s.waiting >= self.limits.prefill)
                || (self.limits.total > 0 && s.inflight_requests >= self.limits.total),
            placed_blocks: index.placed_blocks(self.key),
        }
    }
}

/// What a service's instances share, settled once per service before they are built.
pub(super) struct ServiceParts<'a> {
    pub(super) config: &'a ServiceConfig,
    /// TLS towards the service's `https://` instances (each gets its own SNI).
    pub(super) tls: &'a TlsPeer,
    pub(super) throttle: Option<Arc<Throttle>>,
    /// Instance-scope slot limits of an integrated instance, and of a decode node.
    pub(super) limits: Limits,
    pub(super) decode_limits: Limits,
}

/// An instance's address as resolved now: its id (`<id>/<ip>` with `expand`), the address,
/// and why the name did not resolve (the address then is the previous one, or a placeholder).
struct Resolved {
    id: String,
    addr: SocketAddr,
    unresolved: Option<String>,
}

/// One `services[].instances[]` entry being built.
struct Entry<'a> {
    /// Its YAML path (`services[0].instances[1]`).
    path: &'a str,
    config: &'a InstanceConfig,
    target: &'a Target,
    /// `http[s]://host:port` as configured.
    origin: String,
}

impl Instance {
    /// Appends to `out` the instances of the entry `cfg` at YAML path `path`: one, or one
    /// per address of its name with `expand`. The state of an instance of `prev` with the
    /// same id and address carries over. Errors go to `errs`.
    pub(super) fn build_into(
        path: &str,
        cfg: &InstanceConfig,
        svc: &ServiceParts,
        prev: &[Arc<Instance>],
        out: &mut Vec<Arc<Instance>>,
        errs: &mut Vec<String>,
    ) {
        let target = match cfg.addr.target() {
            Ok(t) => t,
            Err(e) => {
                errs.push(format!("{path}.addr: {e}"));
                return;
            }
        };
        let entry = Entry {
            path,
            config: cfg,
            target,
            origin: format!(
                "{}://{}",
                if target.tls { "https" } else { "http" },
                target.authority
            ),
        };
        for r in entry.addresses(prev) {
            match entry.instance(r, svc, prev, out.len()) {
                Ok(i) => out.push(Arc::new(i)),
                Err(e) => errs.push(e),
            }
        }
    }
}

impl Entry<'_> {
    /// A name that does not resolve (yet) leaves the instance unavailable, not the gateway
    /// down: the previous address of the same instance is kept, and the reloader re-resolves
    /// it (see `crate::resolve`).
    fn single(&self, prev: &[Arc<Instance>]) -> (SocketAddr, Option<String>) {
        let i = self.config;
        match crate::resolve::resolve(&i.addr) {
            Ok(a) => (a, None),
            Err(e) => {
                let kept = prev
                    .iter()
                    .find(|x| x.id == i.id && x.origin == self.origin)
                    .map(|x| x.addr);
                let port = self
                    .target
                    .authority
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse().ok())
                    .unwrap_or(0);
                let a = kept.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], port)));
                (a, Some(e))
            }
        }
    }

    /// The entry's addresses. `expand`: one instance per address of the name (`<id>/<ip>`);
    /// a name that does not resolve keeps the previous ones (unavailable until it does).
    fn addresses(&self, prev: &[Arc<Instance>]) -> Vec<Resolved> {
        let i = self.config;
        let one = |(addr, unresolved)| {
            vec![Resolved {
                id: i.id.clone(),
                addr,
                unresolved,
            }]
        };
        if !i.expand {
            return one(self.single(prev));
        }
        match crate::resolve::resolve_every(&i.addr) {
            Ok(all) if !all.is_empty() => all
                .into_iter()
                .map(|a| Resolved {
                    id: format!("{}/{}", i.id, a.ip()),
                    addr: a,
                    unresolved: None,
                })
                .collect(),
            r => {
                let e = r
                    .err()
                    .unwrap_or_else(|| format!("cannot resolve {:?}: no address", i.addr.as_str()));
                let stem = format!("{}/", i.id);
                let kept: Vec<_> = prev
                    .iter()
                    .filter(|x| x.id.starts_with(&stem) && x.origin == self.origin)
                    .map(|x| Resolved {
                        id: x.id.clone(),
                        addr: x.addr,
                        unresolved: Some(e.clone()),
                    })
                    .collect();
                if kept.is_empty() {
                    let (a, _) = self.single(prev);
                    one((a, Some(e)))
                } else {
                    kept
                }
            }
        }
    }

    /// The instance at address `r`, number `idx` in its service.
    fn instance(
        &self,
        r: Resolved,
        svc: &ServiceParts,
        prev: &[Arc<Instance>],
        idx: usize,
    ) -> Result<Instance, String> {
        let (p, i, s, target) = (self.path, self.config, svc.config, self.target);
        let Resolved {
            id,
            addr,
            unresolved,
        } = r;
        let Ok(host_header) = http::HeaderValue::from_str(&target.authority) else {
            return Err(format!("{p}.addr: {:?} cannot be a Host header", i.addr));
        };
        let auth = i
            .api_key
            .as_ref()
            .or(s.api_key.as_ref())
            .and_then(|k| k.bearer());
        let Ok(id_header) = http::HeaderValue::from_str(&id) else {
            return Err(format!("{p}.id: {:?} cannot be a header value", id));
        };
        let old = prev.iter().find(|x| x.id == id && x.addr == addr);
        if let Some(e) = &unresolved {
            log::warn!("{p} ({}): {e}; it gets no requests until it resolves", id);
        }
        let role = i.role.map_or(Role::Integrated, |r| r.plugin_role());
        Ok(Instance {
            key: InstanceKey::of(&id),
            id,
            id_header,
            addr,
            service: s.name.clone(),
            labels: i.labels.clone(),
            idx,
            load: old.map(|p| p.load.clone()).unwrap_or_default(),
            queue: old.map(|p| p.queue.clone()).unwrap_or_default(),
            remote: old.map(|p| p.remote.clone()).unwrap_or_default(),
            health: {
                let h: Arc<Health> = old.map(|p| p.health.clone()).unwrap_or_default();
                h.set_resolved(unresolved.is_none());
                h
            },
            engine: old.map(|p| p.engine.clone()).unwrap_or_default(),
            engine_max_age_ms: s
                .engine_metrics
                .as_ref()
                .map(|e| 3 * e.interval.as_millis() as u64),
            throttle: svc.throttle.clone(),
            limits: match role {
                Role::Decode => svc.decode_limits,
                Role::Prefill => Limits {
                    prefill: svc.limits.prefill,
                    total: 0,
                },
                Role::Integrated => svc.limits,
            },
            role,
            bootstrap_port: i.bootstrap_port,
            tls: target.tls.then(|| Arc::new(svc.tls.with_sni(&target.host))),
            engine_cache_size: s.engine_metrics.as_ref().is_some_and(|e| e.cache_size),
            config_cache_tokens: i.cache_tokens,
            config_block_tokens: i.cache_block_tokens,
            origin: self.origin.clone(),
            host_header,
            auth,
        })
    }
}
