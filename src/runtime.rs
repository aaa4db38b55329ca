//! The gateway's runtime state built from a [`Config`]: services with their instances (each
//! with its live load and health), each service's prefix index and scheduler, and routes over
//! several services. Held behind an `ArcSwap` ([`crate::shared::Shared`]) so a config reload
//! swaps it atomically; a rebuilt runtime keeps the state of what still exists.

use crate::clock::now_ms;
use crate::config::{Config, ConfigErrors, RouteBy, Timeouts};
use crate::decision::{DecisionSpec, Provider, TargetCriteria};
use crate::engine_metrics::EngineSignals;
use crate::health::Health;
use crate::load::{HasLoad, InstanceLoad, Limits, LoadSnapshot};
use crate::metrics::{Metrics, ServiceCounters};
use crate::pipelines::{self, Scheduler};
use crate::throttle::{Scope, Settings as ThrottleSettings, Throttle};
use log::info;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use tokengate_plugins::{
    Candidate, CostConfig, CostModel, InstanceKey, PrefixIndex, PrefixIndexConfig, PrefixMatch,
    Role, WeightedTargets,
};

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
        let cache_tokens = self.cache_tokens().unwrap_or(0);
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
            cache_tokens,
            // Read only where it is compared with a cache size.
            recent_tokens: if cache_tokens > 0 {
                self.load.recent_tokens(now_ms)
            } else {
                0
            },
        }
    }
}

/// A served model: a pool of instances, the prefix index of what they hold, and how to
/// choose among them.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    /// The model name the engines serve (`model`, else `name`): what the body's `model` says
    /// going up.
    pub served: String,
    /// More names clients may send for it (`aliases`).
    pub aliases: Vec<String>,
    pub instances: Vec<Arc<Instance>>,
    pub sched: Scheduler,
    /// The gateway's model of the instances' KV caches: every prompt dispatched to one of
    /// them is inserted, whatever the scheduler (so the hit-rate ceiling is always known).
    pub index: Arc<PrefixIndex>,
    pub counters: ServiceCounters,
    /// The service's average answer length (kept across reloads): a request's expected
    /// output tokens (`max_tokens` capped by it, see [`crate::load::MeanOutput::expected`]).
    pub output: Arc<crate::load::MeanOutput>,
    /// Request throttling, when configured (kept across reloads: its queue survives).
    pub throttle: Option<Arc<Throttle>>,
    /// Prefill/decode disaggregation: `sched` picks the prefill instance, this the decode one.
    pub pd: Option<Pd>,
    /// HTTP client towards the instances with the service's TLS settings (health checks,
    /// metric scrapes, prefill side requests).
    pub http: reqwest::Client,
}

/// A disaggregated service's protocol and decode picker.
#[derive(Debug)]
pub struct Pd {
    pub mode: crate::config::PdMode,
    /// `pd.decode_policy`.
    pub decode_policy: tokengate_plugins::LbPolicy,
    /// Balances the decode instances (`pd.decode_policy`).
    pub decode: tokengate_plugins::Pipeline,
    /// The decode picker's request counter (round-robin).
    pub turn: std::sync::atomic::AtomicU64,
}

impl Service {
    /// Whether clients call this service by `model` (its name or an alias): the answer then
    /// names the model as the client sent it, else (a route, the default model) the
    /// service's name.
    pub fn answers_to(&self, model: &str) -> bool {
        self.name == model || self.aliases.iter().any(|a| a == model)
    }

    /// The name the answer's `model` gives for a request that asked for `model`.
    pub fn reply_name<'a>(&'a self, model: &'a str) -> &'a str {
        if self.answers_to(model) {
            model
        } else {
            &self.name
        }
    }

    /// Every instance as a candidate at `now` (the pipeline's filters drop the unavailable
    /// ones).
    pub fn candidates(&self, now: u64) -> Vec<Candidate> {
        self.instances
            .iter()
            .map(|i| i.candidate(i.idx, 0, now, &self.index))
            .collect()
    }

    /// Whether an available instance not in `exclude` is left (a retry is possible); for a
    /// disaggregated service, a prefill and a decode instance.
    pub fn has_untried(&self, exclude: &[InstanceKey]) -> bool {
        let now = now_ms();
        let left = |role: Role| {
            self.instances
                .iter()
                .any(|i| i.role == role && !exclude.contains(&i.key) && i.health.available(now))
        };
        match self.pd {
            None => left(Role::Integrated),
            Some(_) => left(Role::Prefill) && left(Role::Decode),
        }
    }
}

/// How a route spreads over its targets.
pub enum RouteMode {
    /// A target by (smooth) weighted round-robin, then the target's own scheduler:
    /// `route_by: weight`, and `round-robin` (equal weights).
    Targets { by: RouteBy, wrr: WeightedTargets },
    /// One scheduler across every target's instances.
    Policy(Scheduler),
}

/// A model name over several services.
pub struct Route {
    pub name: String,
    /// More names clients may send for it (`aliases`).
    pub aliases: Vec<String>,
    pub targets: Vec<Arc<Service>>,
    pub mode: RouteMode,
    /// The decision service: who to ask and what (targets in route order). Asked only when
    /// the route's pipeline has the decision filter.
    pub decision: Option<(Provider, DecisionSpec)>,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route").field("name", &self.name).finish()
    }
}

impl Route {
    /// Every instance of every target at `now`, numbered in target order (`idx` = position
    /// in [`Route::flat`], `target` = target number).
    pub fn candidates(&self, now: u64) -> Vec<Candidate> {
        let mut out = Vec::new();
        for (t, s) in self.targets.iter().enumerate() {
            for i in &s.instances {
                out.push(i.candidate(out.len(), t as u32, now, &s.index));
            }
        }
        out
    }

    /// The instance at a flat index (see [`Route::candidates`]) and its target number.
    pub fn flat(&self, mut idx: usize) -> Option<(usize, &Arc<Instance>)> {
        for (t, s) in self.targets.iter().enumerate() {
            if idx < s.instances.len() {
                return Some((t, &s.instances[idx]));
            }
            idx -= s.instances.len();
        }
        None
    }

    /// The prompt matched against every target's index (instance keys are unique across
    /// services, so the per-instance matches do not collide).
    pub fn match_prefix(&self, blocks: &[u64], now: u64) -> PrefixMatch {
        let mut m = PrefixMatch {
            prompt_blocks: blocks.len() as u32,
            ..PrefixMatch::default()
        };
        for s in &self.targets {
            let t = s.index.match_prefix(blocks, now);
            m.best = m.best.max(t.best);
            m.per_instance.extend(t.per_instance);
        }
        m
    }

    pub fn mode_name(&self) -> &'static str {
        match &self.mode {
            RouteMode::Targets { by, .. } => by.as_str(),
            RouteMode::Policy(_) => "policy",
        }
    }

    /// The route's scheduler when it schedules across targets.
    pub fn scheduler(&self) -> Option<&Scheduler> {
        match &self.mode {
            RouteMode::Policy(s) => Some(s),
            RouteMode::Targets { .. } => None,
        }
    }

    /// Whether a request to this route asks the decision service.
    pub fn asks_decision(&self) -> bool {
        self.decision.is_some()
            && self
                .scheduler()
                .is_some_and(|s| s.needs.contains(tokengate_plugins::Needs::DECISION))
    }
}

fn learned_tps(c: &CostModel, k: InstanceKey) -> Option<f64> {
    let l = c.learned(k);
    (l.prefill_samples > 0).then_some((l.prefill_tps * 10.0).round() / 10.0)
}

fn learned_step(c: &CostModel, k: InstanceKey) -> Option<f64> {
    let l = c.learned(k);
    (l.step_samples > 0).then_some((l.step_ms * 100.0).round() / 100.0)
}

/// What a request's `model` resolves to.
#[derive(Debug, Clone)]
pub enum Dest {
    Service(Arc<Service>),
    Route(Arc<Route>),
    /// An external entry of the split proxy ([`crate::split`]).
    Split(Arc<crate::split::Entry>),
}

/// The name of a service's session table in the replicas' shared store (`cluster:`; services
/// and routes may share names).
pub fn service_sessions(name: &str) -> String {
    format!("svc/{name}")
}

/// The name of a route's session table in the shared store.
pub fn route_sessions(name: &str) -> String {
    format!("route/{name}")
}

impl Dest {
    /// The session a request to this destination is bound by: the name of its table in the
    /// shared store and its key (`None`: no session table here, or no session key).
    pub fn session_target(
        &self,
        headers: &http::HeaderMap,
        info: &crate::api::RequestInfo,
        api: crate::api::Api,
    ) -> Option<(String, tokengate_plugins::SessionKey)> {
        let (sched, name) = match self {
            Dest::Service(s) => (&s.sched, service_sessions(&s.name)),
            Dest::Route(r) => (r.scheduler()?, route_sessions(&r.name)),
            Dest::Split(_) => return None,
        };
        sched.sessions.as_ref()?;
        Some((name, sched.session_key(headers, info, api)?))
    }

    pub fn name(&self) -> &str {
        match self {
            Dest::Service(s) => &s.name,
            Dest::Route(r) => &r.name,
            Dest::Split(e) => &e.name,
        }
    }

    /// Whether an available instance not in `exclude` is left anywhere in the destination
    /// (an external entry has none: its failover goes to other entries).
    pub fn has_untried(&self, exclude: &[InstanceKey]) -> bool {
        match self {
            Dest::Service(s) => s.has_untried(exclude),
            Dest::Route(r) => r.targets.iter().any(|s| s.has_untried(exclude)),
            Dest::Split(_) => false,
        }
    }
}

/// Everything a request needs from the config, swapped as a whole on reload.
#[derive(Debug)]
pub struct Runtime {
    pub services: HashMap<String, Arc<Service>>,
    /// Services in config order (for `/v1/models` and `/admin/instances`).
    pub ordered: Vec<Arc<Service>>,
    pub routes: HashMap<String, Arc<Route>>,
    pub ordered_routes: Vec<Arc<Route>>,
    /// Every alias of a service or route, and what it names.
    pub aliases: HashMap<String, Dest>,
    pub strict: bool,
    pub default_model: Option<String>,
    /// Client keys and their tenants (the global `api_keys`: the implicit tenant); empty:
    /// the gateway is open. Counters kept across reloads by tenant name.
    pub tenants: crate::tenants::Tenants,
    pub admin_token: Option<Vec<u8>>,
    pub max_body_bytes: usize,
    pub timeouts: Timeouts,
    /// Routing headers on or off, the engines' headers that pass (`response_headers:`).
    pub response_headers: crate::config::ResponseHeaders,
    /// Bytes per prefix block: `prefix_index.block_size` tokens × 4 bytes.
    pub block_bytes: usize,
    /// Tokens per prefix block.
    pub block_tokens: usize,
    pub memory: crate::memory::MemoryPolicy,
    pub health_check: crate::config::HealthCheckSettings,
    pub passive: crate::config::PassiveHealthSettings,
    pub maintenance_interval: std::time::Duration,
    /// The config file watcher's settings (`reload:`).
    pub reload: crate::config::ReloadSettings,
    /// Services that scrape their engines' metrics: (service, settings).
    pub engine_metrics: Vec<(Arc<Service>, crate::config::EngineMetricsSettings)>,
    /// The predicted-TTFT model: what every instance's completed requests taught it (kept
    /// across reloads).
    pub cost: Arc<CostModel>,
    /// Global scheduling: this gateway's name (the hop header) and the member gateways.
    pub hop_name: http::HeaderValue,
    pub members: Vec<Member>,
    /// Traffic mirroring (`mirror:`), when configured.
    pub mirror: Option<Arc<crate::mirror::Settings>>,
    /// Split proxy (`split:`), when configured.
    pub split: Option<Arc<crate::split::Split>>,
}

/// Another region's gateway (`global.members[]`).
#[derive(Debug, Clone)]
pub struct Member {
    pub endpoint: Arc<crate::upstream::Endpoint>,
    /// `Bearer <token>` (sensitive: never logged).
    pub auth: Option<http::HeaderValue>,
}

impl Runtime {
    /// Builds the runtime state of a validated config, carrying over from `prev` (a reload):
    /// the load counters and health of instances that still exist (same id and address),
    /// the prefix index of services that still exist (same name; a new TTL applies), and
    /// the session bindings of schedulers that still exist and still bind sessions (same
    /// service or route name; a new TTL or size applies). Errors name the YAML path.
    pub fn build(
        cfg: &Config,
        prev: Option<&Runtime>,
        metrics: &Metrics,
    ) -> Result<Runtime, ConfigErrors> {
        let now = now_ms();
        let mut errs = Vec::new();
        let cm = &cfg.cost_model;
        let cost_cfg = CostConfig {
            prior_prefill_tps: cm.prior_prefill_tokens_per_second,
            prior_step_ms: cm.prior_decode_step.as_secs_f64() * 1000.0,
            alpha: cm.learning_rate,
            miss_penalty: cm.miss_penalty,
            ..CostConfig::default()
        };
        let cost = match prev {
            Some(p) => {
                p.cost.set_config(cost_cfg);
                p.cost.clone()
            }
            None => Arc::new(CostModel::new(cost_cfg)),
        };
        let prev_inst = |id: &str, addr: SocketAddr| -> Option<Arc<Instance>> {
            prev?
                .ordered
                .iter()
                .flat_map(|s| s.instances.iter())
                .find(|i| i.id == id && i.addr == addr)
                .cloned()
        };
        let index_ttl_ms = cfg.prefix_index.ttl.as_millis() as u64;
        let mut services = HashMap::new();
        let mut ordered = Vec::new();
        for (si, s) in cfg.services.iter().enumerate() {
            let prev_svc = prev.and_then(|p| p.services.get(&s.name));
            let throttle = s.throttling.as_ref().map(|t| {
                let settings = ThrottleSettings {
                    overflow: t.overflow,
                    scope: t.scope,
                    limits: Limits {
                        prefill: t.prefill,
                        total: t.total,
                    },
                    decode: t.decode,
                    max_queue: t.max_queue,
                    queue_timeout: t.queue_timeout,
                    retry_after: t.retry_after,
                };
                match prev_svc.and_then(|p| p.throttle.clone()) {
                    Some(old) => {
                        old.set(settings);
                        old
                    }
                    None => Arc::new(Throttle::new(settings)),
                }
            });
            let limits = match &throttle {
                Some(t) if t.settings().scope == Scope::Instance => t.settings().limits,
                _ => Limits::default(),
            };
            let decode_limits = match &throttle {
                Some(t) if t.settings().scope == Scope::Instance => Limits {
                    prefill: 0,
                    total: t.settings().decode,
                },
                _ => Limits::default(),
            };
            // TLS towards the service's https:// instances, and the client of its background
            // loops and side requests.
            let svc_tls = match crate::tls::TlsPeer::new("", s.tls.as_ref()) {
                Ok(t) => t,
                Err(e) => {
                    errs.push(format!("services[{si}].tls.{e}"));
                    continue;
                }
            };
            if s.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) {
                log::warn!(
                    "services[{si}] ({}): tls.insecure_skip_verify is on: the certificates of its https instances are NOT checked (tests only)",
                    s.name
                );
            }
            let http = match crate::tls::client(s.tls.as_ref()) {
                Ok(c) => c,
                Err(e) => {
                    errs.push(format!("services[{si}].tls.{e}"));
                    continue;
                }
            };
            let mut instances = Vec::with_capacity(s.instances.len());
            for (ci, i) in s.instances.iter().enumerate() {
                let p = format!("services[{si}].instances[{ci}]");
                let target = match i.addr.target() {
                    Ok(t) => t,
                    Err(e) => {
                        errs.push(format!("{p}.addr: {e}"));
                        continue;
                    }
                };
                let origin = format!(
                    "{}://{}",
                    if target.tls { "https" } else { "http" },
                    target.authority
                );
                // A name that does not resolve (yet) leaves the instance unavailable, not the
                // gateway down: the previous address of the same instance is kept, and the
                // reloader re-resolves it (see `crate::resolve`).
                let single = || match crate::resolve::resolve(&i.addr) {
                    Ok(a) => (a, None),
                    Err(e) => {
                        let kept = prev
                            .into_iter()
                            .flat_map(|p| p.ordered.iter().flat_map(|s| s.instances.iter()))
                            .find(|x| x.id == i.id && x.origin == origin)
                            .map(|x| x.addr);
                        let port = target
                            .authority
                            .rsplit_once(':')
                            .and_then(|(_, p)| p.parse().ok())
                            .unwrap_or(0);
                        let a = kept.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], port)));
                        (a, Some(e))
                    }
                };
                // `expand`: one instance per address of the name (`<id>/<ip>`); a name that
                // does not resolve keeps the previous ones (unavailable until it does).
                let members: Vec<(String, SocketAddr, Option<String>)> = if i.expand {
                    match crate::resolve::resolve_every(&i.addr) {
                        Ok(all) if !all.is_empty() => all
                            .into_iter()
                            .map(|a| (format!("{}/{}", i.id, a.ip()), a, None))
                            .collect(),
                        r => {
                            let e = r.err().unwrap_or_else(|| {
                                format!("cannot resolve {:?}: no address", i.addr.as_str())
                            });
                            let stem = format!("{}/", i.id);
                            let kept: Vec<_> = prev
                                .into_iter()
                                .flat_map(|p| p.ordered.iter().flat_map(|s| s.instances.iter()))
                                .filter(|x| x.id.starts_with(&stem) && x.origin == origin)
                                .map(|x| (x.id.clone(), x.addr, Some(e.clone())))
                                .collect();
                            if kept.is_empty() {
                                let (a, _) = single();
                                vec![(i.id.clone(), a, Some(e))]
                            } else {
                                kept
                            }
                        }
                    }
                } else {
                    let (a, e) = single();
                    vec![(i.id.clone(), a, e)]
                };
                for (id, addr, unresolved) in members {
                    let Ok(host_header) = http::HeaderValue::from_str(&target.authority) else {
                        errs.push(format!("{p}.addr: {:?} cannot be a Host header", i.addr));
                        continue;
                    };
                    let auth = i
                        .api_key
                        .as_ref()
                        .or(s.api_key.as_ref())
                        .and_then(|k| k.bearer());
                    let id_header = match http::HeaderValue::from_str(&id) {
                        Ok(h) => h,
                        Err(_) => {
                            errs.push(format!("{p}.id: {:?} cannot be a header value", id));
                            continue;
                        }
                    };
                    let old = prev_inst(&id, addr);
                    if let Some(e) = &unresolved {
                        log::warn!("{p} ({}): {e}; it gets no requests until it resolves", id);
                    }
                    let role = i.role.map_or(Role::Integrated, |r| r.plugin_role());
                    instances.push(Arc::new(Instance {
                        id: id.clone(),
                        id_header,
                        addr,
                        service: s.name.clone(),
                        labels: i.labels.clone(),
                        idx: instances.len(),
                        key: InstanceKey::of(&id),
                        load: old.as_ref().map(|p| p.load.clone()).unwrap_or_default(),
                        remote: old.as_ref().map(|p| p.remote.clone()).unwrap_or_default(),
                        health: {
                            let h: Arc<Health> =
                                old.as_ref().map(|p| p.health.clone()).unwrap_or_default();
                            h.set_resolved(unresolved.is_none());
                            h
                        },
                        engine: old.as_ref().map(|p| p.engine.clone()).unwrap_or_default(),
                        engine_max_age_ms: s
                            .engine_metrics
                            .as_ref()
                            .map(|e| 3 * e.interval.as_millis() as u64),
                        throttle: throttle.clone(),
                        limits: match role {
                            Role::Decode => decode_limits,
                            Role::Prefill => Limits {
                                prefill: limits.prefill,
                                total: 0,
                            },
                            Role::Integrated => limits,
                        },
                        role,
                        bootstrap_port: i.bootstrap_port,
                        tls: target.tls.then(|| Arc::new(svc_tls.with_sni(&target.host))),
                        engine_cache_size: s.engine_metrics.as_ref().is_some_and(|e| e.cache_size),
                        config_cache_tokens: i.cache_tokens,
                        config_block_tokens: i.cache_block_tokens,
                        origin: origin.clone(),
                        host_header,
                        auth,
                    }));
                }
            }
            let index = match prev_svc {
                Some(p) => {
                    if p.index.ttl_ms()
                        != index_ttl_ms.div_ceil(tokengate_plugins::prefix::TICK_MS)
                            * tokengate_plugins::prefix::TICK_MS
                    {
                        info!(
                            "service {}: prefix index ttl changed to {:?}",
                            s.name, cfg.prefix_index.ttl
                        );
                        p.index.set_ttl_ms(index_ttl_ms);
                    }
                    p.index.clone()
                }
                None => Arc::new(PrefixIndex::new(PrefixIndexConfig {
                    ttl_ms: index_ttl_ms,
                    ..PrefixIndexConfig::default()
                })),
            };
            let prev_sched = prev_svc.map(|p| &p.sched);
            let sched = match pipelines::service(si, s, prev_sched, &cost, now) {
                Ok(sc) => sc,
                Err(e) => {
                    errs.push(e);
                    continue;
                }
            };
            let svc = Arc::new(Service {
                name: s.name.clone(),
                served: s.served().to_string(),
                aliases: s.aliases.clone(),
                instances,
                sched,
                index,
                counters: metrics.service_counters(&s.name),
                output: prev_svc.map(|p| p.output.clone()).unwrap_or_default(),
                throttle,
                pd: s.pd.as_ref().map(|pd| Pd {
                    mode: pd.mode,
                    decode_policy: pd.decode_policy,
                    decode: pipelines::decode(pd.decode_policy),
                    turn: std::sync::atomic::AtomicU64::new(0),
                }),
                http,
            });
            services.insert(s.name.clone(), svc.clone());
            ordered.push(svc);
        }
        let mut routes = HashMap::new();
        let mut ordered_routes = Vec::new();
        for (ri, r) in cfg.routes.iter().enumerate() {
            let Some(targets) = r
                .targets
                .iter()
                .map(|t| services.get(&t.service).cloned())
                .collect::<Option<Vec<Arc<Service>>>>()
            else {
                errs.push(format!("routes[{ri}].targets: a target is not a service"));
                continue;
            };
            let mode = match (r.route_by(), &r.policy) {
                (RouteBy::Policy, Some(ps)) => {
                    let prev_sched = prev
                        .and_then(|p| p.routes.get(&r.name))
                        .and_then(|p| p.scheduler());
                    match pipelines::policy(
                        &format!("route {}", r.name),
                        &format!("routes[{ri}].policy.plugins"),
                        ps,
                        prev_sched,
                        &cost,
                        now,
                        None,
                    ) {
                        Ok(s) => RouteMode::Policy(s),
                        Err(e) => {
                            errs.push(e);
                            continue;
                        }
                    }
                }
                (RouteBy::Policy, None) => {
                    errs.push(format!(
                        "routes[{ri}].policy: required when route_by is policy"
                    ));
                    continue;
                }
                (by, _) => {
                    let weights: Vec<u32> = match by {
                        RouteBy::Weight => {
                            r.targets.iter().map(|t| t.weight.unwrap_or(0)).collect()
                        }
                        _ => vec![1; r.targets.len()],
                    };
                    RouteMode::Targets {
                        by,
                        wrr: WeightedTargets::new(&weights),
                    }
                }
            };
            let decision = r.decision.as_ref().and_then(|d| {
                let p = cfg.providers.iter().find(|p| p.name == d.provider)?;
                let provider = Provider {
                    name: p.name.clone(),
                    base_url: p.base_url.clone(),
                    api_key: p.api_key.clone(),
                    model: d.model.clone().or_else(|| p.model.clone())?,
                };
                let mut spec = DecisionSpec::new(
                    d.instructions.clone(),
                    r.targets
                        .iter()
                        .map(|t| TargetCriteria {
                            name: t.service.clone(),
                            criteria: t.criteria.clone(),
                        })
                        .collect(),
                );
                spec.timeout = d.timeout;
                Some((provider, spec))
            });
            let route = Arc::new(Route {
                name: r.name.clone(),
                aliases: r.aliases.clone(),
                targets,
                mode,
                decision,
            });
            routes.insert(r.name.clone(), route.clone());
            ordered_routes.push(route);
        }
        if !errs.is_empty() {
            return Err(ConfigErrors(errs));
        }
        if let Some(p) = prev {
            if p.maintenance_interval != cfg.prefix_index.maintenance_interval {
                info!(
                    "prefix_index.maintenance_interval changed to {:?}",
                    cfg.prefix_index.maintenance_interval
                );
            }
        }
        let block_tokens = cfg.prefix_index.block_size.max(1);
        let mut members = Vec::new();
        for (i, m) in cfg.global.members.iter().enumerate() {
            let prev_eps = prev
                .into_iter()
                .flat_map(|p| p.members.iter().map(|m| m.endpoint.clone()));
            match crate::upstream::carried(prev_eps, &m.name, &m.url, None) {
                Ok(endpoint) => {
                    let auth = m.token.as_ref().and_then(|t| {
                        let mut v = http::HeaderValue::from_str(&format!("Bearer {t}")).ok()?;
                        v.set_sensitive(true);
                        Some(v)
                    });
                    members.push(Member { endpoint, auth });
                }
                Err(e) => errs.push(format!("global.members[{i}].url: {e}")),
            }
        }
        if !errs.is_empty() {
            return Err(ConfigErrors(errs));
        }
        let split = match cfg
            .split
            .as_ref()
            .map(|sp| crate::split::Split::build(sp, prev.and_then(|p| p.split.as_deref())))
        {
            None => None,
            Some(Ok(s)) => Some(Arc::new(s)),
            Some(Err(e)) => return Err(ConfigErrors(e)),
        };
        let mirror = match cfg.mirror.as_ref().map(crate::mirror::Settings::new) {
            None => None,
            Some(Ok(s)) => Some(Arc::new(s)),
            Some(Err(e)) => return Err(ConfigErrors(vec![format!("mirror.{e}")])),
        };
        if let Some(p) = prev {
            let was = p.mirror.as_ref().map(|m| m.describe());
            let now = mirror.as_ref().map(|m| m.describe());
            if was != now {
                info!(
                    "mirror: {}",
                    now.as_deref()
                        .unwrap_or("off (copies in flight finish or time out)")
                );
            }
        }
        let engine_metrics = cfg
            .services
            .iter()
            .filter_map(|s| Some((services.get(&s.name)?.clone(), s.engine_metrics.clone()?)))
            .collect();
        let mut aliases = HashMap::new();
        for s in &ordered {
            for a in &s.aliases {
                aliases.insert(a.clone(), Dest::Service(s.clone()));
            }
        }
        for r in &ordered_routes {
            for a in &r.aliases {
                aliases.insert(a.clone(), Dest::Route(r.clone()));
            }
        }
        Ok(Runtime {
            services,
            ordered,
            routes,
            ordered_routes,
            aliases,
            strict: cfg.routing.strict,
            default_model: cfg.routing.default_model.clone(),
            tenants: crate::tenants::Tenants::build(
                &cfg.api_keys,
                &cfg.tenants,
                prev.map(|p| &p.tenants),
            ),
            admin_token: cfg.admin_token.as_ref().map(|t| t.as_bytes().to_vec()),
            max_body_bytes: cfg.max_body_bytes,
            timeouts: cfg.timeouts.clone(),
            response_headers: cfg.response_headers.clone(),
            block_bytes: block_tokens * crate::api::BYTES_PER_TOKEN,
            block_tokens,
            memory: crate::memory::MemoryPolicy::new(
                cfg.prefix_index.memory_threshold_ratio,
                cfg.prefix_index.reserved_memory_gib,
                cfg.prefix_index.memory_limit_bytes,
            ),
            maintenance_interval: cfg.prefix_index.maintenance_interval,
            reload: cfg.reload.clone(),
            health_check: cfg.health_check.clone(),
            passive: cfg.passive_health.clone(),
            engine_metrics,
            cost,
            hop_name: http::HeaderValue::from_str(&cfg.global.name)
                .unwrap_or_else(|_| http::HeaderValue::from_static("tokengate")),
            members,
            mirror,
            split,
        })
    }

    /// The destination of a request's `model`: a service or route by name or alias, else the
    /// default model when routing is not strict.
    pub fn resolve(&self, model: &str) -> Option<Dest> {
        if let Some(s) = self.services.get(model) {
            return Some(Dest::Service(s.clone()));
        }
        if let Some(r) = self.routes.get(model) {
            return Some(Dest::Route(r.clone()));
        }
        if let Some(d) = self.aliases.get(model) {
            return Some(d.clone());
        }
        if self.strict {
            return None;
        }
        let d = self.default_model.as_deref()?;
        self.services.get(d).map(|s| Dest::Service(s.clone()))
    }

    /// Every scheduler (services', then routes' policy schedulers), for maintenance, gauges
    /// and `/admin/instances`.
    pub fn schedulers(&self) -> Vec<(&str, &Scheduler)> {
        let mut v: Vec<(&str, &Scheduler)> = self
            .ordered
            .iter()
            .map(|s| (s.name.as_str(), &s.sched))
            .collect();
        for r in &self.ordered_routes {
            if let Some(s) = r.scheduler() {
                v.push((r.name.as_str(), s));
            }
        }
        v
    }

    /// JSON snapshot of the load table for `/admin/instances`.
    pub fn instances_json(&self) -> serde_json::Value {
        let now = now_ms();
        let list: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .flat_map(|s| s.instances.iter().map(move |i| (s, i)))
            .map(|(s, i)| {
                let l: LoadSnapshot = i.load.snapshot();
                let remote = i.remote.get();
                serde_json::json!({
                    "id": i.id,
                    "service": i.service,
                    "addr": i.addr.to_string(),
                    "url": i.origin,
                    "labels": i.labels,
                    "role": i.role.as_str(),
                    "bootstrap_port": i.bootstrap_port,
                    "inflight_requests": l.inflight_requests,
                    "inflight_tokens": l.inflight_tokens,
                    "waiting": l.waiting,
                    "queued_prefill_tokens": l.prefill_tokens,
                    "other_replicas": {"inflight_requests": remote[0], "inflight_tokens": remote[1],
                        "waiting": remote[2], "queued_prefill_tokens": remote[3]},
                    "recent_tokens": i.load.recent_tokens(crate::clock::now_ms()),
                    "cached_blocks": s.index.held_blocks(i.key),
                    "placed_blocks": s.index.placed_blocks(i.key),
                    "cache_blocks": i.cache_blocks(self.block_tokens),
                    "cache_tokens": i.cache_tokens(),
                    "engine_cache_tokens": i.engine_cache_tokens(),
                    "tokens_per_estimate": i.engine.tokens_per_estimate(),
                    "cache_block_tokens": i.engine_block_tokens(),
                    "slots": i.throttle.as_ref().map(|_| match i.role {
                        // A decode node's slots: its requests from dispatch to completion.
                        Role::Decode => serde_json::json!({
                            "decode": l.inflight_requests,
                            "limits": {"decode": i.limits.total},
                        }),
                        Role::Prefill => serde_json::json!({
                            "prefill": l.waiting,
                            "limits": {"prefill": i.limits.prefill},
                        }),
                        Role::Integrated => serde_json::json!({
                            "prefill": l.waiting,
                            "decode": l.inflight_requests.saturating_sub(l.waiting),
                            "total": l.inflight_requests,
                            "limits": {"prefill": i.limits.prefill, "total": i.limits.total},
                        }),
                    }),
                    "decoding": l.inflight_requests.saturating_sub(l.waiting),
                    "completed": l.completed,
                    "errors": l.errors,
                    "cancelled": l.cancelled,
                    "health": i.health.view(now),
                    "engine": i.engine_max_age_ms.map(|_| i.engine.view(now)),
                    "learned": {
                        "prefill_tokens_per_second": learned_tps(&self.cost, i.key),
                        "decode_step_ms": learned_step(&self.cost, i.key),
                    },
                })
            })
            .collect();
        let schedulers: Vec<serde_json::Value> = self
            .schedulers()
            .into_iter()
            .map(|(name, s)| {
                serde_json::json!({
                    "name": name,
                    "mode": s.mode(),
                    "pipeline": s.describe,
                    "needs": s.needs.names(),
                    "sessions": s.sessions.as_ref().map_or(0, |t| t.gauges().entries),
                })
            })
            .collect();
        let throttles: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .filter_map(|s| {
                let t = s.throttle.as_ref()?;
                let st = t.settings();
                Some(serde_json::json!({
                    "service": s.name,
                    "overflow": format!("{:?}", st.overflow).to_lowercase(),
                    "scope": format!("{:?}", st.scope).to_lowercase(),
                    "limits": {"prefill": st.limits.prefill, "total": st.limits.total, "decode": st.decode},
                    "queued": t.queued(),
                    "max_queue": st.max_queue,
                    "service_slots_in_use": {
                        "prefill": t.pool.prefill.load(std::sync::atomic::Ordering::Relaxed),
                        "total": t.pool.total.load(std::sync::atomic::Ordering::Relaxed),
                        "decode": t.decode_pool.total.load(std::sync::atomic::Ordering::Relaxed),
                    },
                }))
            })
            .collect();
        let indexes: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .map(|s| {
                let g = s.index.gauges();
                serde_json::json!({
                    "service": s.name,
                    "nodes": g.nodes,
                    "blocks": g.blocks,
                    "bytes": g.bytes,
                    "evicted_bytes": g.evicted_bytes,
                    "trims": g.trims,
                    "trimmed_blocks": g.trimmed_blocks,
                    "capacity_evicted_blocks": g.capacity_evicted_blocks,
                })
            })
            .collect();
        let services: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .map(|s| {
                serde_json::json!({
                    "service": s.name,
                    "mean_output_tokens": s.output.get(),
                })
            })
            .collect();
        serde_json::json!({
            "instances": list,
            "services": services,
            "schedulers": schedulers,
            "prefix_indexes": indexes,
            "throttles": throttles,
        })
    }

    /// OpenAI-shaped model list for `GET /v1/models`: the names clients send (never the
    /// engines' served names): services, then routes, each followed by its aliases.
    /// `GET /v1/models`: every service and route by name and alias — for a tenant, those
    /// it may call (a name it allows, or the alias of one).
    pub fn models_json(&self, tenant: Option<&crate::tenants::Tenant>) -> serde_json::Value {
        let allowed = |canonical: &str, name: &str| {
            tenant.is_none_or(|t| t.allows(name) || t.allows(canonical))
        };
        let data: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .flat_map(|s| {
                std::iter::once(&s.name)
                    .chain(&s.aliases)
                    .filter(|n| allowed(&s.name, n))
            })
            .chain(self.ordered_routes.iter().flat_map(|r| {
                std::iter::once(&r.name)
                    .chain(&r.aliases)
                    .filter(|n| allowed(&r.name, n))
            }))
            .map(|name| {
                serde_json::json!({
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokengate",
                })
            })
            .collect();
        serde_json::json!({ "object": "list", "data": data })
    }
}
